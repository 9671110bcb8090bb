"""A failure within 1.5 times its limits is judged again on fresh draws of its case before it counts
(Run.checked): a failure where most of them fail too, ``marginal`` where they do not (shown, never red, never
a new finding); the draws are recorded with it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import pandas as pd
import pytest

from kda_cases.case import Case
from kda_conformance.checks import get_check
from kda_conformance.cli.exits import PASSED, verdict_exit
from kda_conformance.judging.judge import Judge
from kda_conformance.judging.metrics import Measurement
from kda_conformance.repro.upstream import upstream_findings
from kda_conformance.running.config import build_config
from kda_conformance.running.run import Run, redraw_seeds
from kda_conformance.running.runnable import Drawn
from kda_conformance.running.truth import CaseTruth
from kda_kernels import registry
from kda_kernels.protocol import Backend
from kda_reports.findings import Errors, Finding
from kda_reports.schema import record_rows

CASE = Case(seq_lens=(8,), head_k_dim=16, head_v_dim=16, seed=7)


def worst_for(seed: int) -> float:
    """The error/limit the stand-in check reports on a draw: chosen per test."""
    return RATIOS.get(seed, RATIOS.get("other", 0.9))


RATIOS: dict[object, float] = {}


def judged_at_ratio(truth: CaseTruth, backend: Backend, params: Mapping[str, object], judge: Judge) -> list[Finding]:
    """A check whose output's rel-RMS is ``worst_for(seed)`` times its limit."""
    budget = truth.budgets["o"]
    ratio = worst_for(truth.case.seed)
    errors = Errors(0.0, ratio * budget.rel_rms.value, 0.0, 0, True)
    return [judge.verdict(Measurement("o", errors), budget, None)]


def run_on(tmp_path: Path, ratios: dict[object, float], redraws: int | None = None) -> list[Finding]:
    RATIOS.clear()
    RATIOS.update(ratios)
    run = Run(build_config(device="cpu", backends=["torch_chunk"], out=tmp_path, redraws=redraws), journal=False)
    check = dataclasses.replace(get_check("budget"), run=judged_at_ratio)
    return run.checked(check, Drawn(CASE), registry.get("torch_chunk"))


def test_a_failure_at_1_1x_that_fresh_draws_do_not_confirm_is_marginal(tmp_path: Path) -> None:
    [finding] = run_on(tmp_path, {7: 1.1})
    assert finding.verdict == "marginal" and not finding.failed
    assert finding.redraws.startswith("not confirmed: 0 of 8 fresh draws of the case failed it")
    assert all(f"seed {s} passed 0.9x" in finding.redraws for s in redraw_seeds(CASE))
    assert verdict_exit([finding.verdict]) == PASSED
    [row] = record_rows([finding])
    assert row["verdict"] == "marginal" and row["redraws"] == finding.redraws
    assert "0 of 8 fresh draws" in finding.message()


def test_a_failure_the_draws_confirm_stays_a_failure_and_says_so(tmp_path: Path) -> None:
    [finding] = run_on(tmp_path, {"other": 1.2, 7: 1.1})
    assert finding.verdict == "fail" and finding.redraws.startswith("confirmed: 8 of 8 fresh draws")
    mostly = {seed: 1.3 for seed in redraw_seeds(CASE)[:5]}  # 5 of 8 fail: a majority
    [finding] = run_on(tmp_path, {7: 1.1, **mostly})
    assert finding.verdict == "fail" and "5 of 8" in finding.redraws
    half = {seed: 1.3 for seed in redraw_seeds(CASE)[:4]}  # 4 of 8: not a majority
    [finding] = run_on(tmp_path, {7: 1.1, **half})
    assert finding.verdict == "marginal" and "4 of 8" in finding.redraws


def test_a_failure_past_the_margin_or_with_redraws_off_counts_at_once(tmp_path: Path) -> None:
    [far] = run_on(tmp_path, {7: 1.6})
    assert far.verdict == "fail" and far.redraws == ""
    [off] = run_on(tmp_path, {7: 1.1}, redraws=0)
    assert off.verdict == "fail" and off.redraws == ""


def test_redraws_are_new_seeds_the_same_on_every_machine() -> None:
    seeds = redraw_seeds(CASE)
    assert len(seeds) == 8 == len(set(seeds)) and CASE.seed not in seeds
    assert seeds == redraw_seeds(Case.from_json(CASE.to_json()))
    assert redraw_seeds(CASE.replace(seed=8)) != seeds


def test_a_marginal_failure_is_never_a_new_finding(tmp_path: Path) -> None:
    [marginal] = run_on(tmp_path, {7: 1.1})
    [fail] = run_on(tmp_path, {7: 1.1}, redraws=0)

    def new(finding: Finding) -> list:
        return upstream_findings(pd.DataFrame(record_rows([finding])).assign(run_id="r", known_issue=""), ())

    assert new(marginal) == [] and [f.status for f in new(fail)] == ["new"]


@pytest.fixture(autouse=True)
def _forget_ratios() -> None:
    yield
    RATIOS.clear()
