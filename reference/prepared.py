"""Validation and preprocessing shared by every form of the reference.

Both the token loop (the definition) and the chunked form start from the same
prepared tensors, so they can only differ in how they run the recurrence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kda_cases.case import sequence_bounds
from kda_cases.materialize import KDAOptions
from kda_reference.preprocess import beta_activation, gate_activation, l2norm


@dataclass(frozen=True)
class Prepared:
    """Inputs after preprocessing, in one compute dtype, q and k expanded to the value heads.

    ``q`` is already scaled; ``g`` is the per-key log decay; ``h0`` is K-first
    ``[N, HV, K, V]`` (zeros where no initial state was given).
    """

    q: torch.Tensor  # [B, T, HV, K]
    k: torch.Tensor  # [B, T, HV, K]
    v: torch.Tensor  # [B, T, HV, V]
    g: torch.Tensor  # [B, T, HV, K]
    beta: torch.Tensor  # [B, T, HV]
    h0: torch.Tensor  # [N, HV, K, V]
    bounds: list[tuple[int, int, int]]
    checkpoints: tuple[tuple[int, int], ...]
    state_v_first: bool


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    options: KDAOptions,
    dtype: torch.dtype,
) -> Prepared:
    """Check shapes and arguments with chunk_kda's conventions, then preprocess in ``dtype``."""
    o = options
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if HV % H != 0:
        raise ValueError(f"num_v_heads (HV={HV}) must be a multiple of num_heads (H={H})")
    if v.shape[:2] != (B, T) or g.shape != (B, T, HV, K) or beta.shape != (B, T, HV):
        raise ValueError(
            f"expected v [B,T,HV,V], g [B,T,HV,K]={[B, T, HV, K]}, beta [B,T,HV]={[B, T, HV]}; "
            f"got v {list(v.shape)}, g {list(g.shape)}, beta {list(beta.shape)}"
        )
    bounds = sequence_bounds(B, T, o.cu_seqlens)
    N = len(bounds)
    state_shape = (N, HV, V, K) if o.state_v_first else (N, HV, K, V)
    if o.initial_state is not None and tuple(o.initial_state.shape) != state_shape:
        raise ValueError(f"initial_state must have shape {list(state_shape)}, got {list(o.initial_state.shape)}")
    for index, (seq, tokens) in enumerate(o.checkpoints):
        if not 0 <= seq < N:
            raise ValueError(f"checkpoint {index} names sequence {seq}; there are {N} sequences")
        length = bounds[seq][2] - bounds[seq][1]
        if not 0 <= tokens <= length:
            raise ValueError(
                f"checkpoint {index} asks for the state after {tokens} tokens of a {length}-token sequence"
            )

    scale = K**-0.5 if o.scale is None else o.scale
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if o.use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    beta = beta_activation(beta, o.use_beta_sigmoid_in_kernel)
    g = gate_activation(g, in_kernel=o.use_gate_in_kernel, A_log=o.A_log, dt_bias=o.dt_bias, lower_bound=o.lower_bound)
    group = HV // H
    if o.initial_state is None:
        h0 = torch.zeros(N, HV, K, V, dtype=dtype, device=q.device)
    else:
        h0 = o.initial_state.to(dtype)
        h0 = h0.transpose(-1, -2).contiguous() if o.state_v_first else h0.clone()
    return Prepared(
        q=(q * scale).repeat_interleave(group, dim=2),
        k=k.repeat_interleave(group, dim=2),
        v=v,
        g=g,
        beta=beta,
        h0=h0,
        bounds=bounds,
        checkpoints=tuple((int(s), int(p)) for s, p in o.checkpoints),
        state_v_first=o.state_v_first,
    )
