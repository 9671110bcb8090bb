"""The first sweep: fixed cases through the reference and every selected backend, judged by the tolerance policy."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kda_cases.case import Case
from kda_conformance.checks import CHECKS, Drawn
from kda_conformance.checks._tests import fail, fitted_or_unanswered
from kda_conformance.judging.repro import BUDGET_CHECK
from kda_conformance.running.run import Run
from kda_conformance.running.sweep import fit_or_fault
from kda_kernels.protocol import Backend
from kda_reports.findings import failure_report


@pytest.mark.kda_device_dependent
def test_first_sweep(
    first_sweep_case: Case,
    kda_backend: Backend,
    kda_run: Run,
    kda_checked: Callable,
    kda_record: Callable,
    request: pytest.FixtureRequest,
) -> None:
    """The sweep's cases come from --kda-lengths/--kda-dtypes/--kda-heads/--kda-head-dim (plugin), each moved
    into the backend's envelope (a narrow backend runs the grid too); a case that lands on one an earlier
    case of the grid already became is not run twice."""
    backend = kda_backend
    grid = kda_run.config.grid.cases()
    fitted = fitted_or_unanswered(BUDGET_CHECK, first_sweep_case, backend, kda_run, kda_record)
    earlier = {fit_or_fault(backend, c)[0].id for c in grid[: grid.index(first_sweep_case)]}
    if fitted.id in earlier:
        pytest.skip(f"{backend.name}: moved into its envelope, this is {fitted.id}, which an earlier case runs")
    findings = kda_checked(CHECKS[BUDGET_CHECK], Drawn(fitted), backend)
    skipped = [f for f in findings if f.verdict in ("skip", "resource")]
    if skipped:
        pytest.skip(f"{backend.name}: {skipped[0].verdict}: {skipped[0].reason}")
    report = failure_report(findings)
    if report:
        fail(request, findings, report)
