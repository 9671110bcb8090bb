"""Determinism: the same inputs run twice give the same bits. A difference is nondeterminism, named with each
tensor's magnitude and its ratio to that tensor's limit (a warning; a failure under --kda-strict), and both
calls are then judged against the float64 truth: a call outside the budget is a wrong answer, not noise
(a kernel that carries a state from one call to the next), and fails naming the call. The prefix and
poison checks confirm it first, so that a backend that varies by itself is not blamed bitwise for leaking
the future or reading poisoned memory; they judge it against its limits instead."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from hypothesis import strategies as st

from kda_cases.dtypes import bits
from kda_cases.profiles import Profile
from kda_conformance.checks._check import Check
from kda_conformance.checks._registry import draw_case, supported
from kda_conformance.judging.judge import Judge
from kda_conformance.running.blame import call_backend
from kda_conformance.running.runnable import Drawn
from kda_conformance.running.truth import CaseTruth
from kda_kernels.protocol import Backend, BackendOutput
from kda_reports.findings import Budget, Finding

NAME = "determinism"


def largest_change(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest elementwise difference, infinite where one side is not finite and the other differs (or
    where the two runs did not even return the same shape)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return float("inf")
    differs = bits(a) != bits(b)
    if not bool(differs.any()):
        return 0.0
    delta = (a.double() - b.double()).abs()[differs]
    return float(delta.nan_to_num(nan=float("inf")).max())


def nondeterminism(
    judge: Judge, first: BackendOutput, again: BackendOutput, budgets: Mapping[str, Budget]
) -> Finding | None:
    """A warning if two runs on the same inputs gave other bits (output or final state), else None; each
    tensor's change beside its own max-abs limit."""
    changes = {
        name: largest_change(getattr(first, name), getattr(again, name))
        for name in ("o", "final_state")
        if getattr(first, name) is not None and getattr(again, name) is not None
    }
    if not any(changes.values()):
        return None
    words = ", ".join(
        f"{name} by max-abs {change:.3e} ({change / budgets[name].max_abs.value:.3g} of its limit)"
        for name, change in changes.items()
        if change
    )
    return dataclasses.replace(
        judge.passed("the same inputs, run twice"),
        verdict="warn",
        observed="nondeterministic",
        reason=f"two runs on the same inputs differ: {words}",
    )


def repeats_judged(judge: Judge, truth: CaseTruth, first: BackendOutput, again: BackendOutput) -> list[Finding]:
    """Both calls of a backend that varies, each against the truth and the case's budgets: a repeat far from
    the first is wrong when it leaves the budget, whichever of the two calls it is."""
    return [
        finding
        for label, result in (("first call", first), ("second call", again))
        for finding in judge.result(truth.reference, result, truth.budgets, f"the {label}")
    ]


def draw(data: st.DataObject, profile: Profile, backend: Backend) -> Drawn:
    case = draw_case(data, profile, backend)
    supported(backend, case)
    return Drawn(case)


def run(truth: CaseTruth, backend: Backend, params: Mapping[str, object], judge: Judge) -> list[Finding]:
    first, again = call_backend(backend, truth.inputs), call_backend(backend, truth.inputs)
    varies = nondeterminism(judge, first, again, truth.budgets)
    if varies is None:
        return [dataclasses.replace(judge.passed("the same inputs, run twice"), observed="deterministic")]
    return [varies, *repeats_judged(judge, truth, first, again)]


CHECK = Check(
    name=NAME,
    title="determinism",
    suite="properties",
    test_name="test_same_inputs_give_the_same_bits",
    summary="The same inputs run twice give the same bits; a difference is named nondeterminism, with its "
    "magnitude (a warning; a failure under --kda-strict), and a call that then leaves the budget fails.",
    draw=draw,
    run=run,
    ci_seed=0x64657465726D696E69736D,
)
