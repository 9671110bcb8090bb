"""The first sweep: fixed cases through the reference and every selected backend, against provisional budgets."""

from __future__ import annotations

import pytest

from kda_cases.case import Case
from kda_conformance.compare import first_bad, passes, provisional_budget
from kda_conformance.sweep import run_backend
from kda_kernels import registry


@pytest.mark.kda_device_dependent
def test_first_sweep(first_sweep_case: Case, kda_backend_name: str, kda_device, kda_truth, kda_record, request) -> None:  # type: ignore[no-untyped-def]
    """The sweep's cases come from --kda-lengths/--kda-dtypes/--kda-heads/--kda-head-dim (plugin)."""
    case = first_sweep_case
    backend = registry.get(kda_backend_name)
    inputs, truth = kda_truth(case, kda_device)
    outcome = run_backend(case, backend, kda_device, truth, inputs)
    kda_record(outcome)
    if outcome.status == "skip":
        pytest.skip(f"{backend.name}: {outcome.reason}")
    repro = f"pytest '{request.node.nodeid}' --kda-device {kda_device.type}"
    if outcome.status == "error":
        pytest.fail(f"{case.id} ({case.label}) {backend.name} raised {outcome.reason}\nrepro: {repro}")
    failures = []
    for err in outcome.errors:
        budget = provisional_budget(case, err.tensor)
        if not passes(err, budget):
            failures.append(
                f"{case.id} ({case.label}) {backend.name} {err.tensor}: max_abs {err.max_abs:.3e} > budget "
                f"{budget:.1e}; first bad: {first_bad(case, err, budget)} (nonfinite {err.nonfinite}) {err.detail}"
            )
    assert not failures, "\n".join(failures) + f"\nrepro: {repro}"
