"""The rule against a real kernel: FLA's chunk kernel passes, the same kernel with its error doubled fails.

On a CPU FLA runs in Triton's interpreter (the plugin switches it on), so the cases stay small.
"""

from __future__ import annotations

import pytest
import torch

from kda_cases.case import Case
from kda_conformance.judging.judge import judge_for
from kda_conformance.running.truth import case_truth
from kda_kernels import registry

CASES = [
    Case(seq_lens=(130,), initial_state=h0, gate_regime=regime)
    for h0 in ("none", "random")
    for regime in ("typical", "weak")
]


@pytest.mark.slow
@pytest.mark.kda_device_dependent
def test_fla_chunk_passes_and_its_doubled_error_is_caught(kda_device: torch.device) -> None:
    backend = registry.get("fla_chunk")
    if not backend.availability(kda_device):
        pytest.skip(f"fla_chunk: {backend.availability(kda_device).reason}")
    caught = []
    for case in CASES:
        truth = case_truth(case, kda_device)
        result = backend.run(truth.inputs)
        judge = judge_for("budget", case, backend.name, kda_device)
        failed = [f for f in judge.result(truth.reference, result, truth.budgets) if not f.passed]
        assert not failed, [f.problems for f in failed]
        # Twice the error everywhere, stored in the kernel's own dtype.
        doubled = (2 * result.o.double() - truth.reference.o).to(result.o.dtype)
        caught.append(not judge.tensor("o", doubled, truth.reference.o, truth.budgets["o"]).passed)
    assert all(caught), f"a kernel whose error doubled passed some cases: {caught}"
