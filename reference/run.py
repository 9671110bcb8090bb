"""The reference applied to a materialized case, in the exact form that suits its length."""

from __future__ import annotations

from kda_cases.materialize import KDAInputs
from kda_reference.chunked import kda_chunked
from kda_reference.forms import FORMS, default_form
from kda_reference.recurrent import ReferenceResult, kda_recurrent

# From this many tokens on, ``auto`` takes the chunked float64 form (tests hold it within 1e-10 of the
# token loop): below it the loop's few steps cost less than the chunked form's fixed set of batched
# operations. The crossover lies between 4 and 8 tokens on both the 2-core CPU and the H200
# (`kda-conformance benchmark --small`, docs/reference-speed.md).
CHUNKED_FROM_TOKENS = 8


def reference_form(inputs: KDAInputs, form: str = "auto") -> str:
    """Which exact form ``run_reference`` uses: ``loop`` or ``chunked``."""
    if form not in FORMS:
        raise ValueError(f"form={form!r} is not allowed; choose from {', '.join(FORMS)}")
    if form == "auto":
        form = default_form()
    if form != "auto":
        return form
    return "chunked" if inputs.case.total_tokens >= CHUNKED_FROM_TOKENS else "loop"


def run_reference(inputs: KDAInputs, form: str = "auto") -> ReferenceResult:
    """Float64 truth for ``inputs``: outputs, final states and the case's checkpoint states."""
    run = kda_chunked if reference_form(inputs, form) == "chunked" else kda_recurrent
    return run(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, inputs.options)
