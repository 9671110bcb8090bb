"""Prefix invariance: changing every token at and after p leaves the outputs before p bitwise unchanged
(no future leakage)."""

from __future__ import annotations

from collections.abc import Mapping

from hypothesis import assume
from hypothesis import strategies as st

from kda_cases.profiles import Profile
from kda_conformance.checks.derived import changed_after
from kda_conformance.checks.registry import Check, Drawn, draw_case, supported
from kda_conformance.checks.split_resume import CHECK as SPLIT
from kda_conformance.judging.judge import judge_for
from kda_conformance.running.runner import call_backend
from kda_conformance.running.truth import CaseTruth
from kda_kernels.protocol import Backend
from kda_reports.findings import Finding, Location

NAME = "prefix"


def draw(data: st.DataObject, profile: Profile, backend: Backend) -> Drawn:
    case = draw_case(data, profile, backend)
    length = case.total_tokens if case.packed else case.seq_lens[0]
    assume(length >= 2)
    p = data.draw(st.integers(min_value=1, max_value=length - 1), label="p")
    supported(backend, case)
    return Drawn(case, {"at": p})


def run(truth: CaseTruth, backend: Backend, params: Mapping[str, object]) -> list[Finding]:
    case, inputs, p = truth.case, truth.inputs, int(params["at"])  # type: ignore[call-overload]
    judge = judge_for(NAME, case, backend.name, inputs.device, params)
    before = call_backend(backend, inputs).o[:, :p]
    after = call_backend(backend, changed_after(inputs, p)).o[:, :p]
    differs = (before != after) & ~(before.isnan() & after.isnan())
    subject = f"outputs before token {p}"
    if not differs.any():
        return [judge.passed(subject, "o")]
    row, token, head = (int(x) for x in differs.nonzero()[0, :3])
    text = f"outputs before token {p} changed when only tokens from {p} on did"
    return [judge.problem(subject, text, Location(row=row, token=token, head=head), "o")]


CHECK = Check(
    name=NAME,
    title="prefix invariance",
    suite="properties",
    test_name="test_prefix_outputs_ignore_later_tokens",
    summary="Changing every token at and after p leaves the outputs before p bitwise unchanged (no future "
    "leakage).",
    draw=draw,
    run=run,
    ci_seed=0x412B4B5CD4EE363F85931D8E9BCF41C442DC362756D820DA475117D06B6CE6EB8F27689F5E33B921ECE8569F85CDEA80,
    params=SPLIT.params,
)
