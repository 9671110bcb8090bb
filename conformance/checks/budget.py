"""The budget check: output, final state and checkpoint states of a case within the case's budgets."""

from __future__ import annotations

from collections.abc import Mapping

from hypothesis import strategies as st

from kda_cases.profiles import Profile
from kda_conformance.checking.registry import Check, Drawn, draw_case, supported
from kda_conformance.judging.repro import BUDGET_CHECK
from kda_conformance.running.runner import run_backend
from kda_conformance.running.truth import CaseTruth
from kda_kernels.protocol import Backend
from kda_reports.findings import Finding


def draw(data: st.DataObject, profile: Profile, backend: Backend) -> Drawn:
    case = draw_case(data, profile, backend)
    supported(backend, case)
    return Drawn(case)


def run(truth: CaseTruth, backend: Backend, params: Mapping[str, object]) -> list[Finding]:
    return run_backend(truth, backend)


CHECK = Check(
    name=BUDGET_CHECK,
    title="budget",
    suite="properties",
    test_name="test_within_budget",
    summary="Output, final state and checkpoint states of every drawn case within the case's budgets.",
    draw=draw,
    run=run,
    ci_seed=0x779A24424EFC5E695FBB1EBB58EC52B65AAC3A3F3FABC622FC6A653A972CCD950C856D99BC0FA757A5C111461F04784D,
    targets=True,
)
