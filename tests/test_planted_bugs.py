"""The suite catches every planted bug of the zoo in the ci profile, and passes the correct baseline.

One detection run (`kda-conformance detection`: the checks and the corpus, one pytest process) over
every backend of tests/plugins/kda_planted_bugs.py plus torch_chunk; docs/detection.md is the same
table with FLA's kernels added.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from suite_paths import ENV, PLUGINS

from kda_conformance.cli import build_parser
from kda_conformance.cli.detection import DetectionRun, run_detection
from kda_reports.detection import COLUMNS, detection_problems
from kda_reports.findings import Finding

# Slow, every test of it: its module fixture runs the whole zoo's detection (about 115 s on 2 cores).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def zoo(planted_zoo: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    return planted_zoo


@pytest.fixture(scope="module")
def detection(zoo: dict[str, tuple[str, str]], tmp_path_factory: pytest.TempPathFactory) -> DetectionRun:
    env = ENV
    out = tmp_path_factory.mktemp("detection")
    return run_detection([*zoo, "torch_chunk"], ["kda_planted_bugs"], out, profile="ci", device="cpu", env=env)


def test_every_planted_bug_is_caught_with_a_first_bad_point(detection: DetectionRun, zoo: dict) -> None:
    table = detection.table.set_index("backend")
    missed = [name for name in zoo if table.loc[name, "caught by"] == "nothing"]
    assert not missed, detection.output[-3000:]
    located = ("seq ", "row ", "slot ", "checkpoint ")
    no_position = [name for name in zoo if not table.loc[name, "first bad"].startswith(located)]
    assert not no_position, table.loc[no_position].to_string()
    assert detection.returncode == 1


def test_the_correct_baseline_passes_every_case(detection: DetectionRun) -> None:
    row = detection.table.set_index("backend").loc["torch_chunk"]
    assert row["caught by"] == "nothing" and row["cases run"] > 0, detection.output[-3000:]
    assert detection_problems(detection.table, planted=set(detection.table["backend"]) - {"torch_chunk"}) == []


def test_detection_fails_when_a_planted_bug_is_missed_or_a_correct_backend_fails() -> None:
    table = pd.DataFrame(
        [["planted_x", "nothing", 30, "-", "-"], ["good", "budget (case 2)", 30, "seq 0 head 0", "1.5"]],
        columns=COLUMNS,
    )
    assert detection_problems(table, planted={"planted_x"}) == [
        "planted bug planted_x was not caught (30 cases run)",
        "correct backend good failed: budget (case 2)",
    ]


# The bug each metamorphic property exists for: it must be the one that flags it.
PROPERTY_FOR = {
    "planted_future_leak": "prefix invariance",
    "planted_packed_state_leak": "packing isolation",
    "planted_ignores_initial_state": "split resume",
    "planted_wrong_past_2048": "corpus",
    "planted_pool_fresh_reads_slot": "serving: poison",
    "planted_padding_writes_slot0": "serving: poison",
    "planted_pad_wraps_to_last_slot": "serving: poison",
    "planted_uninitialised_output_tail": "serving: poison",
    "planted_checkpoint_slot_unwritten": "serving: checkpoint resume",
    "planted_cu_seqlens_identity_cache": "serving: reused cu_seqlens",
    "planted_pool_dense_addressing": "serving: poison",
    "planted_reads_past_the_end_of_g": "budget",
    "planted_drops_heads_past_full_tiles_of_4": "budget",
    "planted_reads_fp32_gate_as_token_dtype": "corpus",
    "planted_out_from_storage_start": "serving: poison",
    "planted_null_slot_padding_as_a_slot": "serving: poison",
    "planted_l2norm_without_eps": "corpus",
}


@pytest.mark.parametrize("backend", sorted(PROPERTY_FOR))
def test_each_property_catches_its_bug(detection: DetectionRun, backend: str) -> None:
    caught_by = detection.table.set_index("backend").loc[backend, "caught by"]
    assert PROPERTY_FOR[backend] in caught_by, caught_by


def test_failures_carry_the_repro_command_of_their_check(detection: DetectionRun) -> None:
    for entry in detection.entries.values():
        if entry["failed_at"] is not None:
            findings = [Finding.from_dict(data) for data in entry["findings"]]
            assert findings, entry
            for finding in findings:
                assert f"--backend {entry['backend']}" in finding.repro and "repro: " in finding.message(), finding
                budget = entry["check"] in ("budget", "corpus")
                assert ("kda-conformance run " if budget else f"--check {entry['check']}") in finding.repro


# Pastes repro lines into a fresh process, each line starting from the built-in backends alone (as a fresh
# shell would): a line that dropped --plugin would not find its backend.
PASTE = """
import shlex, sys
from kda_conformance.cli import main
from kda_kernels import registry
for line in sys.argv[1:]:
    registry.reset()
    sys.modules.pop("kda_planted_bugs", None)
    print("exit", main(shlex.split(line)[1:]), flush=True)
"""


def test_every_printed_repro_line_reruns_what_it_names(detection: DetectionRun, tmp_path: Path) -> None:
    """Every repro line the zoo's failures printed parses, names its plugin, and (one per check, pasted into
    a fresh process) reproduces its finding: exit 1 where a tensor failed, 3 where the call erred."""
    parser = build_parser()
    planted = str((PLUGINS / "kda_planted_bugs.py").resolve())  # by its path: the line runs as pasted
    first_per_check: dict[str, tuple[str, int]] = {}
    lines = 0
    for entry in detection.entries.values():
        failed = [Finding.from_dict(data) for data in entry["findings"] if data["verdict"] in ("fail", "error")]
        for finding in failed:
            lines += 1
            words = shlex.split(finding.repro)
            args = parser.parse_args(words[1:])
            assert args.plugin == [planted] and words[0] == "kda-conformance", finding.repro
            expected = 1 if any(f.verdict == "fail" for f in failed if f.repro == finding.repro) else 3
            first_per_check.setdefault(entry["check"], (finding.repro, expected))
    assert lines > 100 and len(first_per_check) >= 8, first_per_check
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # a fresh shell's
    repros = [line for line, _ in first_per_check.values()]
    done = subprocess.run(
        [sys.executable, "-c", PASTE, *repros], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600
    )
    codes = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("exit ")]
    assert codes == [code for _, code in first_per_check.values()], done.stdout[-4000:] + done.stderr[-2000:]
