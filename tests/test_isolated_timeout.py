"""Under --isolate, --case-timeout is the backend's call, from its start to its return; the suite's own work
around it (drawing, truth, baseline, comparing) has a clock of its own and is charged to the suite (issue 51:
an instant backend was charged "no result within S s" when the truth was slow)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from suite_paths import PLUGINS, REPO

ENTRY = "from kda_conformance.cli import entry; entry()"


def _run(tmp_path: Path, truth_s: float, call_s: float) -> tuple[int, pd.DataFrame]:
    env = {**os.environ, "PYTHONPATH": str(PLUGINS), "KDA_SLOW_TRUTH_S": str(truth_s), "KDA_SLOW_CALL_S": str(call_s)}
    argv = ["run", "--device", "cpu", "--isolate", "--case-timeout", "2.5", "--plugin", "kda_slow_truth"]
    argv += ["--backend", "slow_call", "--lengths", "20", "--dtypes", "bf16", "--out", str(tmp_path), "--no-dashboard"]
    done = subprocess.run([sys.executable, "-c", ENTRY, *argv], cwd=REPO, env=env, capture_output=True, text=True)
    return done.returncode, pd.read_parquet(next((tmp_path / "runs").glob("*.parquet")))


@pytest.mark.slow
def test_a_slow_truth_and_a_slower_call_each_within_the_timeout_pass(tmp_path: Path) -> None:
    code, records = _run(tmp_path, truth_s=1.5, call_s=1.5)  # 3 s in all, each under 2.5 s
    assert code == 0 and set(records["verdict"]) == {"pass"}, records[["verdict", "reason"]]


@pytest.mark.slow
@pytest.mark.parametrize(("truth_s", "call_s", "who"), [(0, 4, "slow_call"), (4, 0, "(suite)")])
def test_past_the_timeout_the_call_is_the_backends_and_the_truth_the_suites(
    tmp_path: Path, truth_s: float, call_s: float, who: str
) -> None:
    code, records = _run(tmp_path, truth_s, call_s)
    errors = records[records["verdict"] == "error"]
    assert code == 3 and set(errors["backend"]) == {who}, records[["backend", "verdict", "reason"]]
