"""What the vendored-kernel doubles share: the KDA maths (the suite's chunked form in the working dtype) with
the servers' conventions: beta given activated, q/k normalised by a flag, an fp32 state, the output
written into v's buffer, every call's arguments recorded (``CALLS``) for the tests to read."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kda_cases.materialize import KDAOptions
from kda_reference.chunked import kda_chunked

CALLS: list[dict] = []
# Set to a row N, every double's output is wrong from the batch's row N on, as a wrapped offset makes it (a
# standalone file's test plants its bug so).
WRONG_PAST = "KDA_SERVER_DOUBLE_WRONG_PAST"


def softplus_gate(raw_g: torch.Tensor, A_log: torch.Tensor, g_bias: torch.Tensor | None) -> torch.Tensor:
    H, K = raw_g.shape[-2], raw_g.shape[-1]
    bias = 0 if g_bias is None else g_bias.float().view(H, K)
    return -A_log.float().reshape(H, 1).exp() * F.softplus(raw_g.float() + bias)


def lower_bound_gate(raw_g: torch.Tensor, A_log: torch.Tensor, g_bias: torch.Tensor, bound: float) -> torch.Tensor:
    H, K = raw_g.shape[-2], raw_g.shape[-1]
    return bound * torch.sigmoid(A_log.float().reshape(H, 1).exp() * (raw_g.float() + g_bias.float().view(H, K)))


def kda(q, k, v, g, beta, scale, initial_state, l2norm, cu_seqlens, v_first: bool):
    """(o written into v, final state fp32 in the kernel's layout)."""
    assert beta.dtype == torch.float32 and bool(((beta >= 0) & (beta <= 1)).all()), "beta must come activated"
    assert cu_seqlens is None or cu_seqlens.dtype == torch.int32, "the server passes int32 cu_seqlens"
    options = KDAOptions(
        scale=scale,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=l2norm,
        state_v_first=v_first,
    )
    result = kda_chunked(q, k, v, g.float(), beta, options, chunk_size=64, working_dtype=torch.float32)
    if os.environ.get(WRONG_PAST):  # the planted bug
        result.o[:, int(os.environ[WRONG_PAST]) :] += 0.25
    v.copy_(result.o.to(v.dtype))  # as the servers' kernels do: o = v
    return v, result.final_state.float()
