"""A backward pass through autograd: what ``run_backward`` is for a kernel with an autograd function of its own
(FLA's ``chunk_kda``, a callable checked from a test file)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

import torch

from kda_cases.dtypes import stored
from kda_cases.materialize import KDAInputs
from kda_reference.gradients import Gradients

# ``call(leaves) -> (o, final_state)``: the kernel's forward on the inputs in ``leaves`` (by chunk_kda's
# argument names), the initial state among them widened to float32 as the adapters hand it.
T = TypeVar("T")
Forward = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]


def autograd_backward(inputs: KDAInputs, d_o: torch.Tensor, d_final: torch.Tensor | None, call: Forward) -> Gradients:
    """The gradients of ``sum(o * d_o) + sum(final_state * d_final)`` through the kernel's own autograd: every
    input a gradient is taken of (reference/gradients.py) made a leaf that requires one, in its own dtype and
    strides; the initial state's gradient returned in the state's dtype."""
    given = {
        "q": inputs.q,
        "k": inputs.k,
        "v": inputs.v,
        "g": inputs.g,
        "beta": inputs.beta,
        "initial_state": None if inputs.initial_state is None else inputs.initial_state.float(),
        "A_log": inputs.A_log if inputs.case.gate_in_kernel else None,
        "dt_bias": inputs.dt_bias if inputs.case.gate_in_kernel else None,
    }
    # A run computes under inference mode, where nothing is recorded for a backward pass: out of it here.
    with torch.inference_mode(False), torch.enable_grad():
        leaves = {name: _leaf(x) for name, x in given.items() if x is not None}
        o, final = call(leaves)
        if not (o.requires_grad or final.requires_grad):
            raise RuntimeError(
                "the kernel's outputs carry no autograd graph: it has no backward pass here (a forward run under "
                "torch.no_grad or inference_mode, or an op without a derivative)"
            )
        outputs = [x for x in (o, final) if x.requires_grad]
        upstream = {id(o): d_o.to(o.dtype), id(final): None if d_final is None else d_final.to(final.dtype)}
        cotangents = [torch.zeros_like(x) if upstream[id(x)] is None else upstream[id(x)] for x in outputs]
        found = torch.autograd.grad(outputs, list(leaves.values()), cotangents, allow_unused=True)
    pairs = zip(leaves.items(), found, strict=True)
    grads = {name: torch.zeros_like(leaf) if grad is None else grad for (name, leaf), grad in pairs}
    if "initial_state" in grads:
        grads["initial_state"] = stored(inputs.case, "dh0", grads["initial_state"])
    return Gradients(**grads)


def _leaf(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a leaf that requires a gradient (see :func:`fresh`)."""
    return fresh(x).requires_grad_()


def fresh(x: T) -> T:
    """A tensor copied, its strides kept (anything else as it is): made outside inference mode, where the suite
    makes a case's tensors, so that autograd can save it; and a new object, so that a library's cache keyed by
    the identity of its arguments (FLA's ``tensor_cache`` on ``cu_seqlens``) computes its metadata again instead
    of handing back what the forward-only call, in inference mode, made from the same tensor."""
    if not isinstance(x, torch.Tensor):
        return x
    return cast(T, torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x))
