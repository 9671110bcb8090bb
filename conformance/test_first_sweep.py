"""The first sweep: fixed cases through the reference and every selected backend, judged by the tolerance policy."""

from __future__ import annotations

import pytest

from kda_cases.case import Case
from kda_conformance.sweep import run_backend
from kda_conformance.tolerance import failure_message


@pytest.mark.kda_device_dependent
def test_first_sweep(first_sweep_case: Case, kda_backend, kda_device, kda_truth, kda_record) -> None:  # type: ignore[no-untyped-def]
    """The sweep's cases come from --kda-lengths/--kda-dtypes/--kda-heads/--kda-head-dim (plugin)."""
    case, backend = first_sweep_case, kda_backend
    outcome = run_backend(kda_truth(case, kda_device), backend)
    kda_record(outcome)
    if outcome.status == "skip":
        pytest.skip(f"{backend.name}: {outcome.reason}")
    if outcome.status == "error":
        pytest.fail(f"{case.id} ({case.label}) {backend.name} raised {outcome.reason}\n  repro: {outcome.repro}")
    failures = [failure_message(case, backend.name, v, outcome.repro) for v in outcome.failed]
    assert not failures, "\n".join(failures)
