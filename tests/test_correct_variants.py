"""Correct implementations that round elsewhere never go red (tests/plugins/kda_correct_variants.py).

Every control over every check of the ``ci`` profile and the corpus: the baseline's algebra in 16-, 32- and
128-token chunks, a token-serial float32 loop, a parallel scan of the chunks' state maps, and TF32 dots declared
as a design. Each must pass everything, the worst error/limit of each is in the table (docs/detection.md), and
the planted zoo is still caught by the same rules (tests/test_planted_bugs.py). The checks where a control ever
went red (docs/tolerance.md, "Correct implementations never go red") and the corpus run 25 examples per test;
the others the profile's own 3: at 25 they cost CI about 4.5 of its 15 minutes, and no control has failed them
at 25 (``kda-conformance detection --plugin kda_correct_variants --profile ci --examples 25`` runs them all).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from suite_paths import ENV, import_plugin

from kda_conformance.checks import CHECKS, get_check
from kda_conformance.cli.detection import DetectionRun, run_detection
from kda_reports.detection import detection_problems
from kda_reports.findings import worst_ratios
from kda_reports.runfile import read_run

# Slow, every test of it: its module fixtures run every correct variant through every check (about 200 s on 2 cores).
pytestmark = pytest.mark.slow

EXAMPLES = 25
# The tests of the checks that failed a control before their rule changed (budget: chunk 128 and the TF32 design;
# prefix: chunks 16 and 32; a request resumed from a checkpoint: the parallel scan; split and resume), and the
# corpus (chunk 128): 25 examples each. pytest's -k matches these names within the test ids.
SEARCHED = (
    "test_within_budget",
    "test_prefix_outputs_ignore_later_tokens",
    "test_request_resumes_from_checkpoint_slot",
    "test_split_resume_equals_whole_run",
    "test_corpus_case",
)


@pytest.fixture(scope="module")
def variants() -> dict[str, str]:
    return import_plugin("kda_correct_variants").VARIANTS


def _detection(variants: dict[str, str], out: Path, searched: bool) -> DetectionRun:
    chosen = " or ".join(SEARCHED)
    return run_detection(
        list(variants), ["kda_correct_variants"], out, profile="ci", device="cpu", env=ENV,
        examples=EXAMPLES if searched else None, select=chosen if searched else f"not ({chosen})",
    )  # fmt: skip


@pytest.fixture(scope="module")
def detection(variants: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> DetectionRun:
    """The searched checks and the corpus, 25 examples per test."""
    return _detection(variants, tmp_path_factory.mktemp("controls"), searched=True)


@pytest.fixture(scope="module")
def other_checks(variants: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> DetectionRun:
    """Every other check, at the ci profile's own number of examples."""
    return _detection(variants, tmp_path_factory.mktemp("controls_rest"), searched=False)


def detection_records(detection: DetectionRun) -> pd.DataFrame:
    out = Path(detection.command[detection.command.index("--kda-out") + 1])
    return read_run(max((out / "runs").glob("*.parquet"), key=lambda p: p.stat().st_mtime))


def test_the_controls_are_the_variants_the_rules_were_changed_for(variants: dict[str, str]) -> None:
    assert set(variants) == {
        "correct_chunk16", "correct_chunk32", "correct_chunk128", "correct_token_loop_fp32", "correct_parallel_scan",
        "correct_tf32_dots",
    }  # fmt: skip


def _passes(detection: DetectionRun, least_cases: int) -> None:
    table = detection.table.set_index("backend")
    assert detection_problems(detection.table, planted=()) == [], detection.output[-4000:]
    assert detection.returncode == 0, detection.output[-4000:]
    for name, row in table.iterrows():
        # Every property test ran its examples (a control that failed would have stopped early).
        assert row["cases run"] >= least_cases, (name, row["cases run"])
    # Nothing failed or erred; a failure within 1.5x that fresh draws did not confirm is marginal, shown but not
    # red, and every other record is within its limits (1.0: the baseline itself, broken down past the cap).
    records = detection_records(detection)
    assert set(records["verdict"]) <= {"pass", "marginal", "skip"}, records["verdict"].value_counts()
    judged = records[records["verdict"] == "pass"]
    assert worst_ratios(judged).max() <= 1.0
    marginal = records[records["verdict"] == "marginal"]
    assert len(marginal) <= 0.001 * len(judged), marginal[["backend", "check", "label"]]


def test_every_correct_variant_passes_the_searched_checks_with_25_examples(detection: DetectionRun) -> None:
    _passes(detection, 4 * EXAMPLES)
    searched = {check.name for check in CHECKS.values() if check.test_name in SEARCHED}
    assert searched == {"budget", "prefix", "checkpoint", "split_resume"}
    assert {entry["check"] for entry in detection.entries.values()} == searched | {"corpus"}


def test_every_correct_variant_passes_every_other_check(other_checks: DetectionRun) -> None:
    _passes(other_checks, 3 * 6)
    searched = {check.name for check in CHECKS.values() if check.test_name in SEARCHED}
    ran = {entry["check"] for entry in other_checks.entries.values()}
    assert ran and not ran & (searched | {"corpus"})


def test_each_property_test_ran_every_example(detection: DetectionRun, other_checks: DetectionRun) -> None:
    """25 examples each where searched, the profile's 3 elsewhere, or as many as a costly check declares."""

    def wanted(check: str, examples: int) -> int:
        cap = get_check(check).max_examples if check in CHECKS else None
        return min(examples, cap) if cap else examples

    short = [
        (test, entry["examples"])
        for run, examples in ((detection, EXAMPLES), (other_checks, 3))
        for test, entry in run.entries.items()
        if entry["check"] != "corpus" and entry["examples"] and entry["examples"] < wanted(entry["check"], examples)
    ]
    assert not short, short
