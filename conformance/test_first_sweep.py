"""The first sweep: fixed cases through the reference and every selected backend, judged by the tolerance policy."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kda_cases.case import Case
from kda_conformance.check_tests import fail
from kda_conformance.judging.repro import BUDGET_CHECK
from kda_conformance.running.runner import run_backend
from kda_kernels.protocol import Backend
from kda_reports.findings import failure_report


@pytest.mark.kda_device_dependent
def test_first_sweep(
    first_sweep_case: Case, kda_backend: Backend, kda_checked: Callable, request: pytest.FixtureRequest
) -> None:
    """The sweep's cases come from --kda-lengths/--kda-dtypes/--kda-heads/--kda-head-dim (plugin)."""
    backend = kda_backend
    findings = kda_checked(BUDGET_CHECK, first_sweep_case, backend, {}, lambda truth: run_backend(truth, backend))
    skipped = [f for f in findings if f.verdict in ("skip", "resource")]
    if skipped:
        pytest.skip(f"{backend.name}: {skipped[0].verdict}: {skipped[0].reason}")
    report = failure_report(findings)
    if report:
        fail(request, findings, report)
