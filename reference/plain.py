"""The definition as a plain token loop, with chunk_kda's arguments: what a standalone repro carries.

``token_loop`` is the recurrence itself (``kda_reference.recurrent`` runs it on checked, preprocessed inputs);
``kda_token_loop`` adds chunk_kda's conventions around it (scale, q/k l2norm, beta's sigmoid, the gate, GVA,
``cu_seqlens``, the state layout). This module imports nothing of the suite but the preprocessing
(reference/preprocess.py), so ``kda-conformance findings --write-tests`` writes both modules' source verbatim
into a repro that needs torch alone to compute its float64 truth.
"""

import itertools
from typing import Any

import torch

from kda_reference.preprocess import beta_activation, gate_activation, l2norm


def token_loop(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: torch.Tensor,
    bounds: Any,
    checkpoints: Any = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The KDA recurrence, token by token, in the dtype of its inputs: ``q`` (scaled), ``k`` ``[B, T, HV, K]``,
    ``v`` ``[B, T, HV, V]``, ``g`` (the log decay) ``[B, T, HV, K]``, ``beta`` ``[B, T, HV]``, ``h0`` K-first
    ``[N, HV, K, V]``, ``bounds`` ``(row, start, end)`` per sequence; per token::

        S <- S * exp(g_t)                           decay per key row
        S <- S + (beta_t k_t) (v_t - k_t^T S)^T     delta rule on the decayed S
        o_t <- q_t^T S                              read after the update

    Returns the outputs, the final states and the states at ``checkpoints`` ((sequence, tokens) pairs)."""
    B, T, HV, K = q.shape
    V = v.shape[-1]
    decay = torch.exp(g)
    wanted: dict[int, list[tuple[int, int]]] = {}
    for index, (seq, tokens) in enumerate(checkpoints):
        wanted.setdefault(seq, []).append((tokens, index))
    o = torch.zeros(B, T, HV, V, dtype=q.dtype, device=q.device)
    final = torch.zeros(len(bounds), HV, K, V, dtype=q.dtype, device=q.device)
    saved = torch.zeros(len(checkpoints), HV, K, V, dtype=q.dtype, device=q.device)
    for n, (row, start, end) in enumerate(bounds):
        S = h0[n].clone()
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
    return o, final, saved


def kda_token_loop(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    state_v_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA in float64 with chunk_kda's arguments: the outputs ``[B, T, HV, V]`` and the final states
    ``[N, HV, K, V]`` (``[N, HV, V, K]`` when ``state_v_first``), N sequences (``cu_seqlens``: B = 1 and
    N + 1 offsets; else the B rows)."""
    f64 = torch.float64
    q, k, v, g, beta = (x.to(f64) for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * (K**-0.5 if scale is None else scale)
    beta = beta_activation(beta, use_beta_sigmoid_in_kernel)
    g = gate_activation(g, in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    if cu_seqlens is None:
        bounds = [(row, 0, T) for row in range(B)]
    else:
        offsets = [int(x) for x in cu_seqlens]
        bounds = [(0, start, end) for start, end in itertools.pairwise(offsets)]
    h0 = torch.zeros(len(bounds), HV, K, V, dtype=f64, device=q.device)
    if initial_state is not None:
        h0 = initial_state.to(f64).transpose(-1, -2) if state_v_first else initial_state.to(f64)
    o, final, _ = token_loop(q, k, v, g, beta, h0, bounds)
    return o, final.transpose(-1, -2) if state_v_first else final
