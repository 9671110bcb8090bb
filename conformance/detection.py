"""Which property catches which backend's bug, and after how many cases: the detection table.

``kda-conformance detection`` runs the property tests and the corpus (pytest, one process) for the
named backends in one profile, reads the run's ``<run_id>.checks.json`` (examples checked per test
and the first failure, written by the pytest plugin) and tabulates, per backend: the tests that
flagged it, the cases each took, and the first bad point of the first failure. Pointed at the
planted-bug zoo (tests/plugins/kda_planted_bugs.py) it measures the suite's sensitivity; pointed at
correct backends, its specificity (docs/detection.md).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

HERE = Path(__file__).resolve().parent
SUITES = ("test_properties.py", "test_serving.py", "test_corpus.py")
# Short names for the tests, as the table shows them.
PROPERTY_NAMES = {
    "test_within_budget": "budget",
    "test_split_resume_equals_whole_run": "split resume",
    "test_prefix_outputs_ignore_later_tokens": "prefix invariance",
    "test_packed_sequences_match_each_sequence_alone": "packing isolation",
    "test_poisoned_memory_changes_nothing": "serving: poison",
    "test_two_step_prefill_equals_whole_run": "serving: two-step prefill",
    "test_request_resumes_from_checkpoint_slot": "serving: checkpoint resume",
    "test_reused_cu_seqlens_tensor_gets_new_bounds": "serving: reused cu_seqlens",
    "test_corpus_case": "corpus",
}
FIRST_BAD = re.compile(
    r"first bad: (seq \d+ token \d+ head \d+|seq \d+ head \d+|row \d+ token \d+ head \d+)"
    r"|first at (seq \d+ token \d+ head \d+)|output (row position \d+)|(slot \d+)[^\n]*? was written"
)


@dataclass(frozen=True)
class DetectionRun:
    table: pd.DataFrame  # one row per backend
    checks: dict[str, dict]  # pytest node id -> examples, failed_at, message
    returncode: int
    output: str
    command: list[str]


def pytest_command(
    backends: list[str], plugins: list[str], profile: str, device: str, out: Path, seed: int | None = None
) -> list[str]:
    """The pytest command line the detection run uses (the plugin loads itself through ``-p``)."""
    command = [sys.executable, "-m", "pytest", *(str(HERE / name) for name in SUITES)]
    command += ["-q", "-p", "kda_conformance.plugin", "-p", "no:cacheprovider", "--import-mode=importlib"]
    command += ["--kda-device", device, "--kda-profile", profile, "--kda-out", str(out)]
    command += [arg for module in plugins for arg in ("--kda-plugin", module)]
    command += [arg for name in backends for arg in ("--kda-backend", name)]
    if seed is not None:
        command += ["--kda-seed", str(seed)]
    return command


def detection_table(checks: dict[str, dict], backends: list[str]) -> pd.DataFrame:
    """Per backend: which tests flagged it, the cases each took (failed at / examples run), the first bad point."""
    rows = []
    for backend in backends:
        entries = [e for e in checks.values() if e["backend"] == backend]
        corpus = [e for e in entries if e["test"] == "test_corpus_case" and e["examples"]]  # not the skipped
        properties = [e for e in entries if e["test"] != "test_corpus_case"]
        caught, first_bad, cases_run = [], "", 0
        for entry in sorted(properties, key=lambda e: list(PROPERTY_NAMES).index(e["test"])):
            cases_run += entry["examples"]
            if entry["failed_at"] is not None:
                caught.append(f"{PROPERTY_NAMES[entry['test']]} (case {entry['failed_at']})")
                first_bad = first_bad or _first_bad(entry["message"])
        corpus_failed = [e for e in corpus if e["failed_at"] is not None]
        if corpus_failed:
            caught.append(f"corpus ({len(corpus_failed)} of {len(corpus)} cases)")
            first_bad = first_bad or _first_bad(corpus_failed[0]["message"])
        rows.append(
            {
                "backend": backend,
                "caught by": ", ".join(caught) or "nothing",
                "cases run": cases_run + len(corpus),
                "first bad": first_bad or ("-" if not caught else "(no position: " + _kind(entries) + ")"),
            }
        )
    return pd.DataFrame(rows, columns=["backend", "caught by", "cases run", "first bad"])


def _first_bad(message: str) -> str:
    found = FIRST_BAD.search(message)
    return next(group for group in found.groups() if group) if found else ""


def _kind(entries: list[dict]) -> str:
    message = next((e["message"] for e in entries if e["failed_at"] is not None), "")
    return message.splitlines()[0][:80] if message else "no message"


def run_detection(
    backends: list[str],
    plugins: list[str],
    out: Path,
    profile: str = "ci",
    device: str = "cpu",
    seed: int | None = None,
    env: dict[str, str] | None = None,
) -> DetectionRun:
    """Run the properties and the corpus for ``backends`` and tabulate what caught each."""
    command = pytest_command(backends, plugins, profile, device, out, seed)
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    files = sorted((Path(out) / "runs").glob("*.checks.json"))
    if not files:
        raise RuntimeError(f"the detection run wrote no checks file (exit {done.returncode}):\n{done.stdout[-3000:]}")
    checks = json.loads(files[-1].read_text())
    return DetectionRun(detection_table(checks, backends), checks, done.returncode, done.stdout, command)


def table_markdown(run: DetectionRun, descriptions: dict[str, str], shown_command: str) -> str:
    table = run.table.copy()
    table.insert(1, "models", [descriptions.get(name, "") for name in table["backend"]])
    return (
        "# Detection table\n\n"
        f"Produced by `{shown_command}`.\n\n"
        "*caught by*: the tests that flagged the backend, with the drawn case (1-based, in the profile's order) "
        "at which each first failed; for the corpus, how many pinned cases failed. *cases run*: property "
        "examples checked plus corpus cases run. *first bad*: the first point past its limit in the first "
        "failure (`seq S token T head H` for outputs, `seq S head H` for states, `row R token T head H` where "
        "outputs before a change point moved).\n\n" + table.to_markdown(index=False) + "\n"
    )
