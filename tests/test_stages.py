"""The suite's own time: the stage clock, its run file, and the totals of isolated worker processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kda_cases.case import Case
from kda_conformance.checks import get_check
from kda_conformance.cli import main
from kda_conformance.running.isolation import run_isolated
from kda_conformance.running.stages import CLOCK, STAGES, StageClock
from kda_reports.runfile import read_run

CPU = torch.device("cpu")


def test_stages_add_up_and_a_worker_s_totals_merge() -> None:
    clock = StageClock()
    with clock.stage("reference", CPU, "chunked") as lap:
        pass
    clock.forms["chunked"] = 0.5  # a round figure for the sums below
    assert lap.seconds > 0
    with pytest.raises(RuntimeError, match="the kernel's own error"), clock.stage("compare", CPU):
        raise RuntimeError("the kernel's own error")
    with pytest.raises(ValueError, match="stage 'kernel' is not one of materialize, reference"):
        with clock.stage("kernel", CPU):
            pass
    worker = StageClock()
    with worker.stage("backend", CPU):
        pass
    worker.add_form("chunked", 0.25)
    taken = worker.drain()
    assert worker.calls["backend"] == 0 and not worker.forms, "a drain starts the worker's totals again"
    clock.absorb(json.loads(json.dumps(taken)))  # what crosses a pipe or xdist's channel
    snap = clock.snapshot()
    assert snap["calls"] == {**dict.fromkeys(STAGES, 0), "reference": 1, "backend": 1, "compare": 1}
    assert snap["reference_seconds_by_form"] == {"chunked": 0.75}
    assert snap["peak_memory"]["cpu_max_rss_gib"] > 0


def test_a_run_writes_its_time_per_stage_and_each_truth_s_seconds(tmp_path: Path) -> None:
    CLOCK.add_form("loop", 1.0)  # earlier work in this process is not the run's
    args = ["run", "--device", "cpu", "--backend", "torch_chunk", "--lengths", "37,130", "--dtypes", "bf16"]
    assert main([*args, "--out", str(tmp_path), "--no-dashboard", "--reference-form", "chunked"]) == 0
    [timing] = (tmp_path / "runs").glob("*.timing.json")
    seconds = json.loads(timing.read_text())
    cases = 2 * 2 + 1  # lengths x (no h0, random h0), plus the packed batch
    assert seconds["calls"]["reference"] >= cases and seconds["calls"]["backend"] >= cases
    assert set(seconds["reference_seconds_by_form"]) == {"chunked"}
    [records] = (tmp_path / "runs").glob("*.parquet")
    frame = read_run(records)
    assert (frame["reference_form"] == "chunked").all() and (frame["reference_seconds"] > 0).all()


def test_isolated_cases_bring_their_time_back() -> None:
    before = CLOCK.calls["reference"]
    case = Case(seq_lens=(37,), num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    [findings] = list(run_isolated(get_check("budget"), [(case, "torch_chunk")], CPU, [], 120.0))
    assert {f.verdict for f in findings} == {"pass"} and all(f.reference_seconds > 0 for f in findings)
    assert CLOCK.calls["reference"] == before + 1


def test_a_wait_for_gpu_memory_shares_is_its_own_stage(tmp_path) -> None:
    """A night's workers stood still most of a shard on the H200 with nothing in the stages to say so."""
    from kda_conformance.running.memory import memory_shares

    before = CLOCK.snapshot()["calls"]["wait"]
    with memory_shares(tmp_path, 2):
        pass
    assert CLOCK.snapshot()["calls"]["wait"] == before + 1
