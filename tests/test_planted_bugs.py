"""The suite catches every planted bug of the zoo in the ci profile, and passes the correct baseline.

One detection run (`kda-conformance detection`: the checks and the corpus, one pytest process) over
every backend of tests/plugins/kda_planted_bugs.py plus torch_chunk; docs/detection.md is the same
table with FLA's kernels added.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest

from kda_conformance.cli.detection import DetectionRun, run_detection
from kda_reports.detection import COLUMNS, detection_problems
from kda_reports.findings import Finding

PLUGINS = Path(__file__).with_name("plugins")


@pytest.fixture(scope="module")
def zoo(planted_zoo: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    return planted_zoo


@pytest.fixture(scope="module")
def detection(zoo: dict[str, tuple[str, str]], tmp_path_factory: pytest.TempPathFactory) -> DetectionRun:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH")]))}
    out = tmp_path_factory.mktemp("detection")
    return run_detection([*zoo, "torch_chunk"], ["kda_planted_bugs"], out, profile="ci", device="cpu", env=env)


def test_every_planted_bug_is_caught_with_a_first_bad_point(detection: DetectionRun, zoo: dict) -> None:
    table = detection.table.set_index("backend")
    missed = [name for name in zoo if table.loc[name, "caught by"] == "nothing"]
    assert not missed, detection.output[-3000:]
    no_position = [name for name in zoo if not table.loc[name, "first bad"].startswith(("seq ", "row ", "slot "))]
    assert not no_position, table.loc[no_position].to_string()
    assert detection.returncode == 1


def test_the_correct_baseline_passes_every_case(detection: DetectionRun) -> None:
    row = detection.table.set_index("backend").loc["torch_chunk"]
    assert row["caught by"] == "nothing" and row["cases run"] > 0, detection.output[-3000:]
    assert detection_problems(detection.table, planted=set(detection.table["backend"]) - {"torch_chunk"}) == []


def test_detection_fails_when_a_planted_bug_is_missed_or_a_correct_backend_fails() -> None:
    table = pd.DataFrame(
        [["planted_x", "nothing", 30, "-"], ["good", "budget (case 2)", 30, "seq 0 head 0"]], columns=COLUMNS
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
