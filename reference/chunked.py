"""KDA in chunked, matmul form: the algebra the kernels use, written once for two precisions.

Within a chunk of ``C`` tokens, with ``G_t`` the inclusive cumulative log decay
from the chunk start and ``S0`` the state entering the chunk (K-first)::

    D_ts  = exp(G_t - G_s)  (per key, s <= t; never a positive exponent, so nothing overflows)
    A_ts  = sum_k q_t D_ts k_s                  (s <= t)     intra-chunk attention
    L_ts  = beta_t sum_k k_t D_ts k_s           (s < t)      delta-rule coupling
    U     = (I + L)^-1 beta (V - (K * exp(G)) S0)  =  u - w S0
    O     = (Q * exp(G)) S0 + A U
    S_C   = exp(G_C) * S0 + (K * exp(G_C - G))^T U

``working_dtype=None`` runs every step in float64: an exact second form of the
definition in ``recurrent.py`` (tests hold the two within 1e-10 of each other).
A ``working_dtype`` such as bfloat16 gives the same-precision baseline the
tolerance policy measures kernels against: float32 arithmetic and state, with
every matmul operand (and every intermediate a kernel would store: u, w, the
corrected values, the per-chunk state it multiplies) rounded to that dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from kda_reference.prepared import Prepared, prepare
from kda_reference.recurrent import ReferenceResult

DEFAULT_CHUNK = 64
# Elements of the [chunks, HV, C, C, K] pairwise-decay temporaries built at once.
_PAIRWISE_BLOCK = 1 << 25


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    working_dtype: torch.dtype | None = None,
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
    """KDA with ``kda_recurrent``'s arguments and conventions, computed chunk by chunk.

    Returns float64 tensors when ``working_dtype`` is None, else float32 ones
    (the caller casts outputs and states to the dtypes it stores).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    if working_dtype not in (None, torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"working_dtype must be None, bfloat16, float16 or float32, got {working_dtype}")
    compute = torch.float64 if working_dtype is None else torch.float32
    p = prepare(
        q,
        k,
        v,
        g,
        beta,
        dtype=compute,
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
        checkpoints=checkpoints,
    )
    if working_dtype is None or working_dtype == compute:

        def rounded(x: torch.Tensor) -> torch.Tensor:
            return x
    else:

        def rounded(x: torch.Tensor) -> torch.Tensor:
            return x.to(working_dtype).to(compute)

    return _chunked(p, chunk_size, rounded)


def _chunked(p: Prepared, C: int, r: Callable[[torch.Tensor], torch.Tensor]) -> ReferenceResult:
    B, T, HV, K = p.q.shape
    V = p.v.shape[-1]
    N = len(p.bounds)
    device, dtype = p.q.device, p.q.dtype

    # Chunk table: every sequence cut into C-token chunks from its own start; a short
    # last chunk is padded with tokens that change nothing (k = v = q = beta = 0, g = 0).
    first_chunk, chunk_count, token_index = [], [], []
    for row, start, end in p.bounds:
        first_chunk.append(len(token_index))
        count = math.ceil((end - start) / C)
        chunk_count.append(count)
        for j in range(count):
            token_index.append([row * T + start + j * C + i if j * C + i < end - start else -1 for i in range(C)])
    M = len(token_index)
    index = torch.tensor(token_index, dtype=torch.long, device=device).reshape(M, C)
    valid = index >= 0
    safe = index.clamp(min=0)

    def chunked(x: torch.Tensor) -> torch.Tensor:
        # [B, T, HV, *] -> [M, HV, C, *], zero on padding
        flat = x.reshape(B * T, *x.shape[2:])[safe]
        flat = flat * valid.reshape(M, C, *([1] * (flat.dim() - 2))).to(flat.dtype)
        return flat.transpose(1, 2).contiguous()

    q, k, v, g = (chunked(x) for x in (p.q, p.k, p.v, p.g))
    beta = chunked(p.beta.unsqueeze(-1))  # [M, HV, C, 1]
    G = g.cumsum(dim=2)
    G_last = G[:, :, -1:, :]  # padding has g = 0, so this is the decay through the last real token

    A = torch.empty(M, HV, C, C, dtype=dtype, device=device)
    L = torch.empty_like(A)
    step = max(1, _PAIRWISE_BLOCK // max(1, HV * C * C * K))
    inclusive = torch.ones(C, C, dtype=torch.bool, device=device).tril()
    for lo in range(0, M, step):
        hi = min(M, lo + step)
        exponent = G[lo:hi, :, :, None, :] - G[lo:hi, :, None, :, :]  # [m, HV, t, s, K]
        D = torch.exp(exponent.masked_fill(~inclusive[:, :, None], -math.inf))
        A[lo:hi] = (r(q[lo:hi, :, :, None, :] * D) * k[lo:hi, :, None, :, :]).sum(-1)
        L[lo:hi] = (r(k[lo:hi, :, :, None, :] * D) * k[lo:hi, :, None, :, :]).sum(-1)
        del exponent, D
    L = (L * beta).tril(-1)
    A = A.tril()

    eye = torch.eye(C, dtype=dtype, device=device)
    inverse = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    inverse = r(inverse)
    u = r(inverse @ r(beta * v))  # [M, HV, C, V]
    w = r(inverse @ r(beta * k * torch.exp(G)))  # [M, HV, C, K]
    q_decayed = r(q * torch.exp(G))
    k_to_end = r(k * torch.exp(G_last - G))
    decay_end = torch.exp(G_last).squeeze(2).unsqueeze(-1)  # [M, HV, K, 1]
    A = r(A)

    marks: dict[tuple[int, int], list[tuple[int, int]]] = {}
    saved = torch.zeros(len(p.checkpoints), HV, K, V, dtype=dtype, device=device)
    for number, (seq, tokens) in enumerate(p.checkpoints):
        if tokens == 0:
            saved[number] = p.h0[seq]
        else:
            marks.setdefault(((tokens - 1) // C, seq), []).append(((tokens - 1) % C + 1, number))

    S = p.h0.clone()
    out = torch.zeros(M, HV, C, V, dtype=dtype, device=device)
    first = torch.tensor(first_chunk, dtype=torch.long, device=device)
    counts = torch.tensor(chunk_count, dtype=torch.long, device=device)
    for j in range(max(chunk_count, default=0)):
        active = (counts > j).nonzero().squeeze(1) if N > 1 else None
        ids = first[active] + j if active is not None else first + j
        S_in = S[active] if active is not None else S
        S_op = r(S_in)
        U = r(u[ids] - w[ids] @ S_op)
        out[ids] = q_decayed[ids] @ S_op + A[ids] @ U
        for position, n in enumerate(active.tolist() if active is not None else range(N)):
            for tokens, number in marks.get((j, n), ()):
                # The state after `tokens` tokens of this chunk: decay to that token, then the partial sum.
                chunk = int(ids[position])
                G_at = G[chunk, :, tokens - 1 : tokens, :]
                to_at = r(k[chunk, :, :tokens] * torch.exp(G_at - G[chunk, :, :tokens]))
                saved[number] = (
                    torch.exp(G_at).transpose(-1, -2) * S_in[position]
                    + to_at.transpose(-1, -2) @ U[position, :, :tokens]
                )
        S_out = decay_end[ids] * S_in + k_to_end[ids].transpose(-1, -2) @ U
        if active is not None:
            S[active] = S_out
        else:
            S = S_out

    o = torch.zeros(B * T, HV, V, dtype=dtype, device=device)
    o[index[valid]] = out.transpose(1, 2)[valid]
    o = o.reshape(B, T, HV, V)
    if p.state_v_first:
        S, saved = S.transpose(-1, -2), saved.transpose(-1, -2)
    return ReferenceResult(o=o, final_state=S.contiguous(), checkpoint_states=saved.contiguous())
