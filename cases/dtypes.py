"""The tensors every check compares, the dtypes they are stored in, and the dtype tables all layers share.

The stored-dtype rule is written here once: a backend's output is stored in the case's input dtype and
its states (final and checkpoint) in the case's state dtype, whatever precision the kernel computed in; a
gradient in its input's dtype (as autograd and FLA's backward return them).
"""

from __future__ import annotations

from typing import overload

import torch

from kda_cases.case import Case

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Unit roundoff u of each stored dtype: half the distance from 1 to the next representable number.
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 2.0**-24}
# The tensors a result is checked on, in the order every report lists them.
CHECKED_TENSORS = ("o", "final_state", "checkpoint_states")
# The gradients a backward pass is checked on, by the input each is taken of (chunk_kda's argument names), named
# as FLA's tests name them: the gradient of ``sum(o * d_o) + sum(final_state * d_final)``.
GRADIENT_TENSORS = {
    "q": "dq",
    "k": "dk",
    "v": "dv",
    "g": "dg",
    "beta": "dbeta",
    "initial_state": "dh0",
    "A_log": "dA_log",
    "dt_bias": "ddt_bias",
}
# Tensors laid out per token ([B, T, heads, ...]): their errors are located at a (sequence, token, head).
TOKEN_TENSORS = ("o", "dq", "dk", "dv", "dg", "dbeta")
# Gradients of parameters shared by every token of every sequence: sums over all of them.
PARAMETER_GRADIENTS = ("dA_log", "ddt_bias")
INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def stored_dtype_name(case: Case, tensor: str) -> str:
    """``bf16``, ``fp16`` or ``fp32``: outputs in the input dtype, states in the case's state dtype, gradients
    in their inputs' dtypes (g's and beta's may be float32 beside bf16 tokens; A_log and dt_bias are float32)."""
    if tensor in ("o", "dq", "dk", "dv"):
        return case.dtype
    if tensor in ("dg", "dbeta"):
        return case.dtype if case.gate_dtype == "same" else case.gate_dtype
    if tensor in PARAMETER_GRADIENTS:
        return "fp32"
    if tensor in ("final_state", "checkpoint_states", "dh0"):
        return case.state_dtype
    known = (*CHECKED_TENSORS, *GRADIENT_TENSORS.values())
    raise ValueError(f"tensor {tensor!r} is not checked; choose one of {', '.join(known)}")


def stored_dtype(case: Case, tensor: str) -> torch.dtype:
    """The torch dtype ``tensor`` is stored in for ``case`` (see :func:`stored_dtype_name`)."""
    return TORCH_DTYPES[stored_dtype_name(case, tensor)]


@overload
def stored(case: Case, tensor: str, x: torch.Tensor) -> torch.Tensor: ...


@overload
def stored(case: Case, tensor: str, x: None) -> None: ...


def stored(case: Case, tensor: str, x: torch.Tensor | None) -> torch.Tensor | None:
    """``x`` rounded to the dtype ``tensor`` is stored in, as a server stores it (None stays None)."""
    return None if x is None else x.to(stored_dtype(case, tensor))


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``: how messages name a torch dtype."""
    return str(dtype).removeprefix("torch.")


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits, so NaN compares equal to the same NaN and -0 differs from 0."""
    return x.contiguous().view(INT_OF_SIZE[x.element_size()])
