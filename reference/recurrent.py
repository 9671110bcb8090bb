"""The definition: KDA as a float64 token-by-token recurrence.

Per sequence and value head, with ``q`` already scaled and the state ``S`` K-first
``[K, V]``, for each token ``t``::

    S   <- S * exp(g_t)[:, None]                 decay per key row
    S   <- S + (beta_t k_t) (v_t - k_t^T S)^T    delta rule on the decayed S
    o_t <- q_t^T S                               read after the update

Everything runs in float64 on the inputs' device; nothing is lower precision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from kda_reference.preprocess import beta_activation, gate_activation, l2norm


@dataclass(frozen=True)
class ReferenceResult:
    """Float64 truth. States use the layout that was asked for (K-first or V-first)."""

    o: torch.Tensor  # [B, T, HV, V]
    final_state: torch.Tensor  # [N, HV, K, V] or [N, HV, V, K]
    checkpoint_states: torch.Tensor  # [C, HV, K, V] or [C, HV, V, K], C = len(checkpoints)


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


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
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
) -> ReferenceResult:
    """Run the KDA recurrence in float64 with chunk_kda's conventions.

    Shapes: ``q, k [B,T,H,K]``, ``v [B,T,HV,V]``, ``g [B,T,HV,K]``, ``beta [B,T,HV]``;
    ``initial_state [N,HV,K,V]`` (``[N,HV,V,K]`` when ``state_v_first``).
    ``checkpoints`` lists ``(sequence, tokens)`` pairs: the state of that sequence
    after its first ``tokens`` tokens (0 gives its initial state).
    """
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

    f64 = torch.float64
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(f64) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    beta = beta_activation(beta, use_beta_sigmoid_in_kernel)
    g = gate_activation(g, in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    group = HV // H
    q = (q * scale).repeat_interleave(group, dim=2)
    k = k.repeat_interleave(group, dim=2)
    decay = torch.exp(g)

    wanted: dict[int, list[tuple[int, int]]] = {}
    for index, (seq, tokens) in enumerate(checkpoints):
        if not 0 <= seq < N:
            raise ValueError(f"checkpoint {index} names sequence {seq}; there are {N} sequences")
        length = bounds[seq][2] - bounds[seq][1]
        if not 0 <= tokens <= length:
            raise ValueError(
                f"checkpoint {index} asks for the state after {tokens} tokens of a {length}-token sequence"
            )
        wanted.setdefault(seq, []).append((tokens, index))

    o = torch.zeros(B, T, HV, V, dtype=f64, device=q.device)
    final = torch.zeros(N, HV, K, V, dtype=f64, device=q.device)
    saved = torch.zeros(len(checkpoints), HV, K, V, dtype=f64, device=q.device)
    for n, (row, start, end) in enumerate(bounds):
        S = torch.zeros(HV, K, V, dtype=f64, device=q.device)
        if initial_state is not None:
            h0 = initial_state[n].to(f64)
            S = h0.transpose(-1, -2).clone() if state_v_first else h0.clone()
        marks = sorted(wanted.get(n, []))
        for tokens, index in marks:
            if tokens == 0:
                saved[index] = S
        for t in range(start, end):
            S = S * decay[row, t].unsqueeze(-1)
            k_t = k[row, t]
            residual = v[row, t] - torch.einsum("hk,hkv->hv", k_t, S)
            S = S + torch.einsum("hk,hv->hkv", beta[row, t].unsqueeze(-1) * k_t, residual)
            o[row, t] = torch.einsum("hk,hkv->hv", q[row, t], S)
            for tokens, index in marks:
                if tokens == t - start + 1:
                    saved[index] = S
        final[n] = S
    if state_v_first:
        final, saved = final.transpose(-1, -2), saved.transpose(-1, -2)
    return ReferenceResult(o=o, final_state=final.contiguous(), checkpoint_states=saved.contiguous())
