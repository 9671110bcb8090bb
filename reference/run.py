"""The reference applied to a materialized case, in the exact form that suits its length."""

from __future__ import annotations

from kda_cases.materialize import KDAInputs
from kda_reference.chunked import kda_chunked
from kda_reference.recurrent import ReferenceResult, kda_recurrent

# On a GPU, from this many tokens on, the chunked float64 form (tests hold it within 1e-10
# of the token loop) replaces the loop, whose cost there is one kernel launch-bound step
# per token. On a CPU the loop is still the faster of the two (python -m kda_reference.benchmark).
CHUNKED_FROM_TOKENS = 1024
FORMS = ("auto", "loop", "chunked")


def reference_form(inputs: KDAInputs, form: str = "auto") -> str:
    """Which exact form ``run_reference`` uses: ``loop`` or ``chunked``."""
    if form not in FORMS:
        raise ValueError(f"form={form!r} is not allowed; choose from {', '.join(FORMS)}")
    if form != "auto":
        return form
    on_gpu = inputs.device.type != "cpu"
    return "chunked" if on_gpu and inputs.case.total_tokens >= CHUNKED_FROM_TOKENS else "loop"


def run_reference(inputs: KDAInputs, form: str = "auto") -> ReferenceResult:
    """Float64 truth for ``inputs``: outputs, final states and the case's checkpoint states."""
    run = kda_chunked if reference_form(inputs, form) == "chunked" else kda_recurrent
    return run(
        inputs.q,
        inputs.k,
        inputs.v,
        inputs.g,
        inputs.beta,
        **inputs.kernel_kwargs(),
        checkpoints=inputs.case.checkpoints,
    )
