"""The reference applied to a materialized case."""

from __future__ import annotations

from kda_cases.materialize import KDAInputs
from kda_reference.recurrent import ReferenceResult, kda_recurrent


def run_reference(inputs: KDAInputs) -> ReferenceResult:
    """Float64 truth for ``inputs``: outputs, final states and the case's checkpoint states."""
    return kda_recurrent(
        inputs.q,
        inputs.k,
        inputs.v,
        inputs.g,
        inputs.beta,
        **inputs.kernel_kwargs(),
        checkpoints=inputs.case.checkpoints,
    )
