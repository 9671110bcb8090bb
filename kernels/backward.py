"""A backward pass through autograd: what ``run_backward`` is for a kernel with an autograd function of its own
(FLA's ``chunk_kda``, a callable checked from a test file)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from kda_cases.dtypes import stored
from kda_cases.materialize import KDAInputs
from kda_reference.gradients import Gradients

# ``call(q, k, v, g, beta, **keywords) -> (o, final_state)``: the kernel's forward as its adapter calls it.
T = TypeVar("T")
Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# The keywords that carry an input a gradient is taken of: where a call passes them, they become leaves.
LEAF_KEYWORDS = ("initial_state", "A_log", "dt_bias")


def autograd_backward(
    inputs: KDAInputs,
    d_o: torch.Tensor,
    d_final: torch.Tensor | None,
    call: Forward,
    keywords: dict[str, Any],
) -> Gradients:
    """The gradients of ``sum(o * d_o) + sum(final_state * d_final)`` through the kernel's own autograd:
    ``call(q, k, v, g, beta, **keywords)`` with every input a gradient is taken of (reference/gradients.py) made
    a leaf that requires one, in its own dtype and strides (the initial state widened to float32, as the
    adapters hand it; its gradient returned in the state's dtype), and the other keywords' tensors copied
    (:func:`fresh`)."""
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
        kwargs = {name: fresh(x) for name, x in keywords.items()}
        kwargs.update({name: leaves.get(name) for name in LEAF_KEYWORDS if name in kwargs})
        o, final = call(*(leaves[name] for name in ("q", "k", "v", "g", "beta")), **kwargs)
        if not (o.requires_grad or final.requires_grad):
            raise RuntimeError(
                "the kernel's outputs carry no autograd graph: it has no backward pass here (a forward run under "
                "torch.no_grad or inference_mode, or an op without a derivative)"
            )
        outputs = [x for x in (o, final) if x.requires_grad]
        upstream = {id(o): d_o.to(o.dtype), id(final): None if d_final is None else d_final.to(final.dtype)}
        cotangents = [torch.zeros_like(x) if upstream[id(x)] is None else upstream[id(x)] for x in outputs]
        found = torch.autograd.grad(outputs, list(leaves.values()), cotangents, materialize_grads=True)
    grads = dict(zip(leaves, found, strict=True))
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
