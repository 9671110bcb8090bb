"""TEST DOUBLE of AITER's chunk_kimi_delta_attn: AITER's signature and checks, the suite's float64 reference
inside (see tests/plugins/aiter_double/README.md)."""

from __future__ import annotations

import torch

from aiter.ops.triton._triton_kernels.kimi_delta_attn import chunk_fwd
from kda_cases.materialize import KDAOptions
from kda_reference.recurrent import kda_recurrent


def chunk_kimi_delta_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    disable_recompute: bool = False,
    chunk_size: int | None = None,
    cu_seqlens: torch.LongTensor | None = None,
    out: torch.Tensor | None = None,
    state_cache: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise ValueError(f"`initial_state` must be fp32, got {initial_state.dtype}.")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`.")
    if safe_gate and use_gate_in_kernel and (lower_bound is None or not -5 <= lower_bound < 0):
        raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}.")
    if chunk_size not in (None, 32, 64):
        raise ValueError(f"`chunk_size` must be either 32 or 64 for chunk_delta_attn, got {chunk_size}.")
    path, chunk = chunk_fwd.choose_path(
        chunk_size,
        q=q,
        v=v,
        safe_gate=safe_gate,
        use_gate_in_kernel=use_gate_in_kernel,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        lower_bound=lower_bound,
        A_log=A_log,
    )
    paged = state_cache is not None
    if paged:
        if path != "flash_kda":
            raise ValueError("paged state_cache is only implemented on the FlashKDA path")
        if initial_state is not None:
            raise ValueError("state_cache replaces initial_state")
        if not state_v_first:
            raise ValueError("paged state_cache is V-first")
        if out is None or out.shape != v.shape:
            raise ValueError("paged state_cache needs an explicit out buffer shaped like v")
        if state_cache.dtype != torch.float32:
            raise ValueError("state_cache must be an fp32 [slots, H, V, K] tensor")
        slots = state_indices.long()
        initial_state = torch.where(
            has_initial_state.view(-1, 1, 1, 1), state_cache[slots], torch.zeros_like(state_cache[slots])
        )
    chunk_fwd.record(
        path=path,
        chunk_size=chunk_size,
        chunk=chunk,
        paged=paged,
        safe_gate=safe_gate,
        state_v_first=state_v_first,
        initial_state_dtype=None if initial_state is None else initial_state.dtype,
        output_final_state=output_final_state,
        cu_seqlens_dtype=None if cu_seqlens is None else cu_seqlens.dtype,
    )
    options = KDAOptions(
        scale=scale,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        state_v_first=state_v_first,
    )
    truth = kda_recurrent(q, k, v, g, beta, options)
    o = truth.o.to(q.dtype)
    if paged:
        out.copy_(o)
        state_cache[slots] = truth.final_state.float()
        return out, None
    return o, truth.final_state.float() if output_final_state else None
