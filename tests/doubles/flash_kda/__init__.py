"""A test double of MoonshotAI's ``flash_kda`` package: ``fwd`` with the checks of its csrc/flash_kda.cpp (bar
the device: it runs on the CPU) and the maths of its kernel (q/k normalised, beta's sigmoid and the
lower-bound gate inside, a V-first state), computed by the suite's chunked form in fp32. Each call's
arguments are kept in ``CALLS``."""

from __future__ import annotations

import torch

from kda_cases.materialize import KDAOptions
from kda_reference.chunked import kda_chunked

CALLS: list[dict] = []


def fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None,
        cu_seqlens=None):  # fmt: skip
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("out", out)):
        if not x.is_contiguous():
            raise RuntimeError("all tensors must be contiguous")
        if x.dtype != torch.bfloat16:
            raise RuntimeError(f"{name} must be bfloat16")
    B, _, H, D = q.shape
    if D != 128:
        raise RuntimeError("currently only supports D == 128")
    if v.shape != q.shape:
        raise RuntimeError("v must match q shape")
    if A_log.dtype != torch.float32 or A_log.shape != (H,):
        raise RuntimeError("A_log must be [H]")
    if dt_bias.dtype != torch.float32 or dt_bias.shape != (H, D):
        raise RuntimeError("dt_bias must be [H, D]")
    if cu_seqlens is not None and (cu_seqlens.dtype != torch.int64 or B != 1):
        raise RuntimeError("cu_seqlens must be int64")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    for name, state in (("initial_state", initial_state), ("final_state", final_state)):
        if state is not None and tuple(state.shape) != (N, H, D, D):
            raise RuntimeError(f"{name} must be [N, H, D, D]")
    if initial_state is not None and final_state is not None and initial_state.dtype != final_state.dtype:
        raise RuntimeError("initial_state and final_state must have the same dtype")
    CALLS.append({"scale": scale, "cu_seqlens": cu_seqlens, "initial_state": initial_state, "lower_bound": lower_bound})
    options = KDAOptions(
        scale=scale,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        use_gate_in_kernel=True,
        A_log=A_log,
        dt_bias=dt_bias.reshape(-1),
        lower_bound=lower_bound,
        state_v_first=True,
    )
    result = kda_chunked(q, k, v, g, beta, options, chunk_size=16, working_dtype=torch.float32)
    out.copy_(result.o.to(out.dtype))
    if final_state is not None:
        final_state.copy_(result.final_state)
