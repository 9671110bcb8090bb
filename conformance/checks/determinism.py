"""Determinism: the same inputs run twice give the same bits. A difference is nondeterminism, named with its
magnitude (a warning; a failure under --kda-strict). The prefix and poison checks confirm it first, so
that a backend that varies by itself is not blamed for leaking the future or reading poisoned memory."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from hypothesis import strategies as st

from kda_cases.dtypes import bits
from kda_cases.profiles import Profile
from kda_conformance.checking.registry import Check, Drawn, draw_case, supported
from kda_conformance.judging.judge import Judge, judge_for
from kda_conformance.running.runner import call_backend
from kda_conformance.running.truth import CaseTruth
from kda_kernels.protocol import Backend, BackendOutput
from kda_reports.findings import Finding

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


def nondeterminism(judge: Judge, first: BackendOutput, again: BackendOutput, limit: float) -> Finding | None:
    """A warning if two runs on the same inputs gave other bits (output or final state), else None."""
    changes = {
        name: largest_change(getattr(first, name), getattr(again, name))
        for name in ("o", "final_state")
        if getattr(first, name) is not None and getattr(again, name) is not None
    }
    if not any(changes.values()):
        return None
    words = ", ".join(f"{name} by max-abs {change:.3e}" for name, change in changes.items() if change)
    reason = f"two runs on the same inputs differ: {words} ({changes.get('o', 0.0) / limit:.3g} of the o limit)"
    return dataclasses.replace(
        judge.passed("the same inputs, run twice"), verdict="warn", observed="nondeterministic", reason=reason
    )


def draw(data: st.DataObject, profile: Profile, backend: Backend) -> Drawn:
    case = draw_case(data, profile, backend)
    supported(backend, case)
    return Drawn(case)


def run(truth: CaseTruth, backend: Backend, params: Mapping[str, object]) -> list[Finding]:
    judge = judge_for(NAME, truth.case, backend.name, truth.inputs.device, params)
    first, again = call_backend(backend, truth.inputs), call_backend(backend, truth.inputs)
    varies = nondeterminism(judge, first, again, truth.budgets["o"].max_abs.value)
    return [varies or dataclasses.replace(judge.passed("the same inputs, run twice"), observed="deterministic")]


CHECK = Check(
    name=NAME,
    title="determinism",
    suite="properties",
    test_name="test_same_inputs_give_the_same_bits",
    summary="The same inputs run twice give the same bits; a difference is named nondeterminism, with its "
    "magnitude (a warning; a failure under --kda-strict).",
    draw=draw,
    run=run,
    ci_seed=0x64657465726D696E69736D,
)
