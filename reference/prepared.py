"""Validation and preprocessing shared by every form of the reference.

Both the token loop (the definition) and the chunked form start from the same
prepared tensors, so they can only differ in how they run the recurrence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from kda_reference.preprocess import beta_activation, gate_activation, l2norm


def sequence_bounds(
    batch: int, length: int, cu_seqlens: torch.Tensor | Sequence[int] | None
) -> list[tuple[int, int, int]]:
    """``(batch row, start, end)`` of every sequence: one per row, or the ``cu_seqlens`` spans of row 0."""
    if cu_seqlens is None:
        return [(b, 0, length) for b in range(batch)]
    bounds = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    if batch != 1:
        raise ValueError(f"cu_seqlens needs batch size 1 (packed sequences), got batch size {batch}")
    if len(bounds) < 2 or bounds[0] != 0 or any(nxt < prev for prev, nxt in pairwise(bounds)):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing with at least 2 entries, got {bounds}")
    if bounds[-1] > length:
        raise ValueError(f"cu_seqlens ends at {bounds[-1]} but the inputs hold only {length} tokens")
    return [(0, s, e) for s, e in pairwise(bounds)]


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
    *,
    dtype: torch.dtype,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    checkpoints: Sequence[tuple[int, int]] = (),
) -> Prepared:
    """Check shapes and arguments with chunk_kda's conventions, then preprocess in ``dtype``."""
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
    bounds = sequence_bounds(B, T, cu_seqlens)
    N = len(bounds)
    state_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    if initial_state is not None and tuple(initial_state.shape) != state_shape:
        raise ValueError(f"initial_state must have shape {list(state_shape)}, got {list(initial_state.shape)}")
    for index, (seq, tokens) in enumerate(checkpoints):
        if not 0 <= seq < N:
            raise ValueError(f"checkpoint {index} names sequence {seq}; there are {N} sequences")
        length = bounds[seq][2] - bounds[seq][1]
        if not 0 <= tokens <= length:
            raise ValueError(
                f"checkpoint {index} asks for the state after {tokens} tokens of a {length}-token sequence"
            )

    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    beta = beta_activation(beta, use_beta_sigmoid_in_kernel)
    g = gate_activation(g, in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    group = HV // H
    if initial_state is None:
        h0 = torch.zeros(N, HV, K, V, dtype=dtype, device=q.device)
    else:
        h0 = initial_state.to(dtype)
        h0 = h0.transpose(-1, -2).contiguous() if state_v_first else h0.clone()
    return Prepared(
        q=(q * scale).repeat_interleave(group, dim=2),
        k=k.repeat_interleave(group, dim=2),
        v=v,
        g=g,
        beta=beta,
        h0=h0,
        bounds=bounds,
        checkpoints=tuple((int(s), int(p)) for s, p in checkpoints),
        state_v_first=state_v_first,
    )
