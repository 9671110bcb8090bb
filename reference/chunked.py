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
definition in ``recurrent.py`` (tests hold the two within 1e-10 of each other on
every axis, on the CPU and on a GPU), and the fast one: A and L are two matmuls
of ``Q exp(G - m)`` and ``K exp(G - m)`` with ``K exp(m - G)`` (``m`` the middle
of the chunk's range of G, so neither factor leaves float64's exponent range),
u and w one triangular solve, and the only sequential part, the state entering
each chunk, one matmul per step (``_exact_states``). The outputs come from those
states in one product after the loop. It works through the chunks a block at a
time, so its memory beyond the inputs and outputs does not grow with the tokens.

A ``working_dtype`` such as bfloat16 gives the same-precision baseline the
tolerance policy measures kernels against: float32 arithmetic and state, with
every matmul operand (and every intermediate a kernel would store: u, w, the
corrected values, the per-chunk state it multiplies) rounded to that dtype,
and A and L from the pairwise decays themselves, as the kernels round them.

Two options give the baseline of a kernel that computes otherwise by design, or rounds in other places:
``tf32_dots`` rounds every matmul operand to TF32 (float32 with a 10-bit mantissa, as NVIDIA's tensor cores
take float32 operands: what FLA's and SGLang's chunk kernels choose for their float32 dots): ``"nearest"``
(ties to even, as cuBLAS converts) or ``"truncated"`` (the low 13 bits dropped, as Triton's TF32 dots
leave them for the tensor cores to ignore), and
``state_pass="scan"`` computes the states entering the chunks by a parallel (Hillis-Steele) scan of the
chunks' affine maps instead of one chunk after another, as a kernel whose inter-chunk pass is a tree does.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch

from kda_cases.materialize import KDAOptions
from kda_reference.prepared import Raw, check_inputs
from kda_reference.recurrent import ReferenceResult

DEFAULT_CHUNK = 64
# How the working-precision baseline passes the state from chunk to chunk: one chunk after another, or a
# parallel scan of the chunks' affine maps.
STATE_PASSES = ("serial", "scan")
TF32_OPERANDS = ("nearest", "truncated")
# The widest range of G within one chunk (per key) the float64 form factors as exp(G_t - m) exp(m - G_s):
# both exponents stay within +-600, far inside float64's +-709, so neither factor overflows or goes subnormal.
FACTORED_SPAN = 1200.0
# Elements of the [x, C, C, K] pairwise-decay temporaries built at once.
_PAIRWISE_BLOCK = 1 << 25
# Rows of A and L per band of pairwise decays.
_PAIRWISE_ROWS = 16
# The exact form's block of chunks: about this many elements per [chunks x heads, C, K] temporary (128 MiB
# in float64; at 16 heads x 128^2, 128 chunks of 64 tokens), so its memory stays bounded at any length.
EXACT_BLOCK_ELEMENTS = 1 << 24


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    options: KDAOptions | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    working_dtype: torch.dtype | None = None,
    carried_state_dtype: torch.dtype | None = None,
    block_elements: int | None = None,
    tf32_dots: str | None = None,
    state_pass: str = "serial",
) -> ReferenceResult:
    """KDA with ``kda_recurrent``'s arguments and conventions, computed chunk by chunk.

    Returns float64 tensors when ``working_dtype`` is None, else float32 ones
    (the caller casts outputs and states to the dtypes it stores). The exact form works through the
    chunks a block at a time (about ``block_elements`` elements per ``[chunks x heads, C, K]`` temporary),
    so its memory beyond the inputs and outputs does not grow with the tokens; the working-precision
    baseline takes every chunk in one block (its arithmetic, which sets the budgets, unchanged).
    ``carried_state_dtype`` (a working precision only) keeps the state between chunks in that dtype: it is
    rounded to it as it enters each chunk and as it leaves the last (a sequence with no tokens gives back its
    initial state so rounded), the baseline of a kernel that declares such a state (FlashKDA holds a bf16
    state on chip between its 16-token chunks). ``tf32_dots`` and ``state_pass`` (a working precision only):
    see the module's docstring.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    if working_dtype not in (None, torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"working_dtype must be None, bfloat16, float16 or float32, got {working_dtype}")
    if block_elements is not None and block_elements < 1:
        raise ValueError(f"block_elements must be a positive integer, got {block_elements}")
    if state_pass not in STATE_PASSES:
        raise ValueError(f"state_pass must be one of {', '.join(STATE_PASSES)}, got {state_pass!r}")
    if tf32_dots not in (None, *TF32_OPERANDS):
        raise ValueError(f"tf32_dots must be None, {' or '.join(map(repr, TF32_OPERANDS))}, got {tf32_dots!r}")
    if working_dtype is None and (carried_state_dtype is not None or tf32_dots or state_pass != "serial"):
        raise ValueError(
            "carried_state_dtype, tf32_dots and state_pass need a working_dtype: the exact form computes in float64"
        )
    compute = torch.float64 if working_dtype is None else torch.float32
    raw = check_inputs(q, k, v, g, beta, options or KDAOptions(), compute)
    rounded = Rounding(working_dtype or compute, compute, carried_state_dtype, tf32_dots, state_pass == "scan")
    exact = working_dtype is None
    block = (block_elements or EXACT_BLOCK_ELEMENTS) if exact else None
    return _chunked(raw, chunk_size, rounded, exact, block)


def _chunked(raw: Raw, C: int, r: Rounding, exact: bool, block_elements: int | None) -> ReferenceResult:
    B, T = raw.q.shape[:2]
    HV, K, V = raw.v.shape[2], raw.q.shape[-1], raw.v.shape[-1]
    device, dtype = raw.q.device, raw.dtype
    plan = _ChunkPlan.build(raw.bounds, T, C, B * T, device)
    M, steps = plan.chunks, len(plan.active)
    ends = [*plan.offsets[1:], M]  # one past the last chunk of each step
    per_chunk = HV * C * max(K, V)
    most = M if block_elements is None else max(1, block_elements // per_chunk)

    o = torch.zeros(B * T + 1, HV, V, dtype=dtype, device=device)  # the last row takes the padding
    # Sequences with no tokens keep their initial state (as the kernel holds it: a declared state dtype's)
    final = r.state(raw.h0.clone())
    saved = torch.zeros(len(raw.checkpoints), HV, K, V, dtype=dtype, device=device)
    # The states entering the next block's first step, of the sequences still going on there.
    entering = raw.h0[plan.order[: plan.active[0]]].reshape(-1, K, V) if M else raw.h0.new_zeros(0, K, V)
    first = 0
    while first < steps:
        last = first + 1  # one past the block's last step: whole steps, at most `most` chunks (at least one step)
        while last < steps and ends[last] - plan.offsets[first] <= most:
            last += 1
        entering = _block(raw, plan, first, last, C, r, exact, entering, o, final, saved)
        first = last

    o = o[: B * T].reshape(B, T, HV, V)
    if raw.state_v_first:
        final, saved = final.transpose(-1, -2), saved.transpose(-1, -2)
    return ReferenceResult(o=o, final_state=final.contiguous(), checkpoint_states=saved.contiguous())


def _block(
    raw: Raw,
    plan: _ChunkPlan,
    first: int,
    last: int,
    C: int,
    r: Rounding,
    exact: bool,
    entering: torch.Tensor,
    o: torch.Tensor,
    final: torch.Tensor,
    saved: torch.Tensor,
) -> torch.Tensor:
    """Steps ``first`` to ``last`` - 1 of ``plan``: their outputs into ``o``, the final states of the
    sequences that end there into ``final``, their checkpoints into ``saved``; returns the states entering
    step ``last``. ``entering``: the states entering step ``first``."""
    HV, K, V = raw.v.shape[2], raw.q.shape[-1], raw.v.shape[-1]
    device, dtype = raw.q.device, raw.dtype
    c0 = plan.offsets[first]
    c1 = plan.offsets[last] if last < len(plan.offsets) else plan.chunks
    X = (c1 - c0) * HV  # (chunk, head) pairs, the batch of every matmul below

    # The block's tokens, preprocessed, [chunks*C, HV, D] -> [X, C, D]; padding rows are zeros (k = v = q =
    # beta = 0, g = 0: padded tokens change nothing).
    rows = plan.rows[c0:c1]
    # One tensor for all five, as the matmuls below always saw them (the baseline's bits depend on it).
    whole = c0 == 0 and c1 == plan.chunks
    flat = torch.cat([x.reshape(x.shape[0], HV, -1) for x in raw.rows(rows.reshape(-1), whole)], dim=-1)
    chunks = flat.reshape(c1 - c0, C, HV, -1).transpose(1, 2).reshape(X, C, -1)
    q, k, v, g, beta = chunks.split([K, K, V, K, 1], dim=-1)
    del flat
    G = g.cumsum(dim=1)
    G_last = G[:, -1:, :]  # padding has g = 0, so this is the decay through the last real token

    A, L = _intra_exact(q, k, G) if exact else _pairwise(q, k, G, r)
    A = r(A.tril())
    L = (L * beta).tril(-1)  # the unit diagonal of I + L stays implicit (unitriangular solves)
    beta_k_decayed = beta * k * torch.exp(G)
    if exact:
        solved = torch.linalg.solve_triangular(
            L, torch.cat([beta * v, beta_k_decayed], -1), upper=False, unitriangular=True
        )
        u, w = solved[..., :V], solved[..., V:]
    else:
        # Kernels invert I + L and store the inverse, u and w at their own precision.
        eye = torch.eye(C, dtype=dtype, device=device).expand_as(L)
        inverse = r.dot(r(torch.linalg.solve_triangular(r.dot(L), eye, upper=False, unitriangular=True)))
        u = r(inverse @ r.dot(r(beta * v)))
        w = r(inverse @ r.dot(r(beta_k_decayed)))
    del L, beta_k_decayed
    q_decayed = r(q * torch.exp(G))
    k_to_end = r(k * torch.exp(G_last - G)).transpose(1, 2)  # [X, K, C]
    decay_end = torch.exp(G_last).transpose(1, 2)  # [X, K, 1]

    # The only sequential part: the state entering each chunk. Chunks are stored step-major, so the
    # chunks of step j are one contiguous block and every step works on views.
    S_in = torch.empty(X, K, V, dtype=dtype, device=device)
    S_in[: plan.active[first] * HV] = entering
    steps = _Steps(plan, first, last, c0, HV, S_in, final, entering)
    if exact:
        U, entering = _exact_states(steps, u, w, k_to_end, decay_end)
        out = torch.baddbmm(A @ U, q_decayed, S_in)
    else:
        states = _scanned_states if r.scan else _rounded_states
        U, entering = states(steps, r, u, w, k_to_end, decay_end)
        out = r.dot(q_decayed) @ r.dot(r(S_in)) + r.dot(A) @ r.dot(U)
    for number, (seq, tokens) in enumerate(raw.checkpoints):
        if tokens == 0:
            saved[number] = raw.h0[seq]
            continue
        # The state after `tokens` tokens: the state entering their chunk, decayed to the last of them,
        # plus the partial sum over the chunk's tokens so far.
        step, t = (tokens - 1) // C, (tokens - 1) % C + 1
        if not first <= step < last:
            continue
        at = (plan.offsets[step] - c0 + plan.rank[seq]) * HV
        here = slice(at, at + HV)
        G_at = G[here, t - 1 : t, :]
        to_at = r.dot(r(k[here, :t] * torch.exp(G_at - G[here, :t])))
        saved[number] = torch.exp(G_at).transpose(-1, -2) * S_in[here] + to_at.transpose(-1, -2) @ r.dot(U[here, :t])

    o[rows] = out.reshape(c1 - c0, HV, C, V).transpose(1, 2)
    return entering


@dataclass(frozen=True)
class _Steps:
    """Steps ``first`` to ``last`` - 1 of ``plan``, whose chunks start at chunk ``c0``: the states entering
    them go into ``S_in`` (the first step's already there, ``entering``), the final states of the
    sequences that end among them into ``final``."""

    plan: _ChunkPlan
    first: int
    last: int
    c0: int
    heads: int
    S_in: torch.Tensor
    final: torch.Tensor
    entering: torch.Tensor

    def fields(self) -> tuple[Any, ...]:
        return (self.plan, self.first, self.last, self.c0, self.heads, self.S_in, self.final, self.entering)


def _exact_states(
    steps: _Steps, u: torch.Tensor, w: torch.Tensor, k_to_end: torch.Tensor, decay_end: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The states entering steps ``first`` to ``last`` - 1 into ``S_in`` (its first step's already there),
    in float64; returns ``U = u - w S_in`` and the states entering step ``last``.

    Per chunk the state map is affine, ``S' = M S + b`` with ``M = diag(exp(G_C)) - K_end^T w`` and
    ``b = K_end^T u``, so M and b are batched products for the whole block and each step is one
    in-place matmul into the slots of the next step, which hold b beforehand: one launch per step,
    where launches, not the GPU, bound the loop."""
    plan, first, last, c0, HV, S_in, final, entering = steps.fields()
    K, V = S_in.shape[-2:]
    M = torch.bmm(k_to_end, w).neg_()
    M.diagonal(dim1=-2, dim2=-1).add_(decay_end.squeeze(-1))
    b = torch.bmm(k_to_end, u)
    # Each slot past the first step holds b of the same sequence's chunk one step before.
    source = [plan.offsets[j - 1] - c0 + rank for j in range(first + 1, last) for rank in range(plan.active[j])]
    if source:
        chunks = torch.tensor(source, dtype=torch.long, device=S_in.device)
        heads = (chunks[:, None] * HV + torch.arange(HV, device=S_in.device)).reshape(-1)
        S_in[plan.active[first] * HV :] = b[heads]
    for j in range(first, last):
        offset, active = plan.offsets[j] - c0, plan.active[j]
        going_on = plan.active[j + 1] if j + 1 < len(plan.active) else 0
        here, going = offset * HV, going_on * HV
        if going_on and j + 1 < last:
            following = (plan.offsets[j + 1] - c0) * HV
            S_in[following : following + going].baddbmm_(M[here : here + going], S_in[here : here + going])
        elif going_on:
            entering = torch.baddbmm(b[here : here + going], M[here : here + going], S_in[here : here + going])
        if going_on < active:
            ending = slice(here + going, (offset + active) * HV)
            done = torch.baddbmm(b[ending], M[ending], S_in[ending])
            final[plan.order[going_on:active]] = done.reshape(-1, HV, K, V)
    return torch.baddbmm(u, w, S_in, alpha=-1), entering


def _rounded_states(
    steps: _Steps,
    r: Rounding,
    u: torch.Tensor,
    w: torch.Tensor,
    k_to_end: torch.Tensor,
    decay_end: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_exact_states`` at working precision, rounding where the kernels store: the corrected values U
    of each chunk and the state they multiply, then the next state from them (the order of operations
    the budgets were set with, kept bit for bit)."""
    plan, first, last, c0, HV, S_in, final, entering = steps.fields()
    K, V = S_in.shape[-2:]
    U = torch.empty(u.shape[0], u.shape[1], V, dtype=u.dtype, device=u.device)
    for j in range(first, last):
        offset, active = plan.offsets[j] - c0, plan.active[j]
        here = slice(offset * HV, (offset + active) * HV)
        if r.carried not in (None, r.compute):  # a declared state precision: kept so between chunks
            S_in[here] = r.state(S_in[here])
        S = S_in[here]
        U[here] = r(u[here] - r.dot(w[here]) @ r.dot(r(S)))
        decayed = decay_end[here] * S
        going_on = plan.active[j + 1] if j + 1 < len(plan.active) else 0
        if going_on == active and j + 1 < last:
            following = slice((plan.offsets[j + 1] - c0) * HV, (plan.offsets[j + 1] - c0 + active) * HV)
            S_in[following] = decayed + r.dot(k_to_end[here]) @ r.dot(U[here])
            continue
        nxt = decayed + r.dot(k_to_end[here]) @ r.dot(U[here])
        if going_on and j + 1 < last:
            start = (plan.offsets[j + 1] - c0) * HV
            S_in[start : start + going_on * HV] = nxt[: going_on * HV]
        elif going_on:
            entering = nxt[: going_on * HV].clone()
        final[plan.order[going_on:active]] = r.state(nxt[going_on * HV :]).reshape(-1, HV, K, V)
    return U, entering


@dataclass(frozen=True)
class _ChunkPlan:
    """Every sequence cut into C-token chunks from its own start, stored step-major.

    Sequences are ranked by chunk count, longest first, so the ``active[j]``
    sequences that still have a chunk at step ``j`` are the first ranks, and
    their chunks sit at ``offsets[j]``, ``offsets[j] + 1``, ... in rank order.
    """

    chunks: int
    order: list[int]  # sequence index at each rank
    rank: dict[int, int]  # sequence index -> rank
    active: list[int]  # per step
    offsets: list[int]  # per step: the first chunk of that step
    rows: torch.Tensor  # [chunks, C] token index into the [B*T] flat tokens; B*T (one past them) on padding

    @staticmethod
    def build(bounds: list[tuple[int, int, int]], T: int, C: int, padding: int, device: torch.device) -> _ChunkPlan:
        counts = [math.ceil((end - start) / C) for _, start, end in bounds]
        order = sorted(range(len(bounds)), key=lambda n: -counts[n])
        steps = counts[order[0]] if order else 0
        active = [sum(1 for c in counts if c > j) for j in range(steps)]
        offsets = [0, *itertools.accumulate(active)][:steps]
        first, length = [0] * sum(counts), [0] * sum(counts)
        for r, n in enumerate(order):
            row, start, end = bounds[n]
            for j in range(counts[n]):
                first[offsets[j] + r] = row * T + start + j * C
                length[offsets[j] + r] = min(C, end - start - j * C)
        lanes = torch.arange(C, device=device)
        valid = lanes < torch.tensor(length, dtype=torch.long, device=device).reshape(-1, 1)
        rows = torch.where(valid, torch.tensor(first, dtype=torch.long, device=device).reshape(-1, 1) + lanes, padding)
        rank = {n: r for r, n in enumerate(order)}
        return _ChunkPlan(len(first), order, rank, active, offsets, rows)


def _intra_exact(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A and L in float64 as two matmuls: exp(G_t - G_s) = exp(G_t - m) exp(m - G_s), m the middle of the
    chunk's range of G per key. Exact where that range fits float64's exponent with room to spare;
    the (chunk, head) pairs where it does not (gates far stronger than any kernel is fed) go pairwise."""
    top = G.amax(dim=1, keepdim=True).clamp(min=0)
    bottom = G.amin(dim=1, keepdim=True).clamp(max=0)
    middle = (top + bottom) / 2
    ahead, behind = torch.exp(G - middle), torch.exp(middle - G)
    k_behind = (k * behind).transpose(1, 2)
    A = (q * ahead) @ k_behind
    L = (k * ahead) @ k_behind
    too_wide = ((top - bottom) > FACTORED_SPAN).any(dim=-1).squeeze(1).nonzero().squeeze(1)
    if too_wide.numel():
        A[too_wide], L[too_wide] = _pairwise(q[too_wide], k[too_wide], G[too_wide], Rounding(q.dtype, q.dtype))
    return A, L


def _pairwise(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, r: Rounding) -> tuple[torch.Tensor, torch.Tensor]:
    """A and L from the pairwise decays exp(G_t - G_s) themselves (s <= t), built a block at a time.

    Rows go in bands of ``_PAIRWISE_ROWS``, each only as wide as its last row's ``s <= t`` (the pairs
    above the diagonal are cleared by the caller's ``tril``): every pair that counts is the same
    elementwise product and the same sum over K as over the whole square, in about 60 % of the work."""
    X, C, K = q.shape
    A = torch.zeros(X, C, C, dtype=q.dtype, device=q.device)
    L = torch.zeros_like(A)
    inclusive = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    for t0 in range(0, C, _PAIRWISE_ROWS):
        t1 = min(C, t0 + _PAIRWISE_ROWS)
        above = ~inclusive[t0:t1, :t1, None]
        step = max(1, _PAIRWISE_BLOCK // ((t1 - t0) * t1 * K))
        for lo in range(0, X, step):
            hi = min(X, lo + step)
            exponent = G[lo:hi, t0:t1, None, :] - G[lo:hi, None, :t1, :]  # [x, t, s, K]
            D = torch.exp(exponent.masked_fill_(above, -math.inf))
            keys = r.dot(k[lo:hi, None, :t1, :])
            A[lo:hi, t0:t1, :t1] = (r.dot(r.product(q[lo:hi, t0:t1, None, :], D)) * keys).sum(-1)
            L[lo:hi, t0:t1, :t1] = (r.dot(r.product(k[lo:hi, t0:t1, None, :], D)) * keys).sum(-1)
            del exponent, D
    return A, L


@dataclass(frozen=True)
class Rounding:
    """Where the baseline rounds: to ``store`` (the dtype a kernel keeps an intermediate in) and back to
    ``compute``; nothing when the two are equal (the exact form, a float32 baseline)."""

    store: torch.dtype
    compute: torch.dtype
    carried: torch.dtype | None = None  # the dtype the state is kept in between chunks (None: ``compute``)
    tf32: str | None = None  # matmul operands rounded ("nearest") or cut ("truncated") to TF32 (``dot``)
    scan: bool = False  # the states entering the chunks by a parallel scan (``_scanned_states``)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.store == self.compute else x.to(self.store).to(self.compute)

    def dot(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as a matmul takes it: rounded to TF32 where the dots are TF32, else unchanged (a bf16 or fp16
        value is a TF32 value already, so only float32 operands move)."""
        return round_to_tf32(x, truncate=self.tf32 == "truncated") if self.tf32 else x

    def state(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (a carried state) rounded to the dtype the state is kept in."""
        return x if self.carried in (None, self.compute) else x.to(self.carried).to(self.compute)

    def product(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``self(a * b)`` in one pass: multiplied in ``compute`` and written rounded to ``store`` (same
        bits: both round the compute dtype's product to nearest even), read back as ``compute`` by the
        next product's type promotion."""
        if self.store == self.compute:
            return a * b
        shape = torch.broadcast_shapes(a.shape, b.shape)
        return torch.mul(a, b, out=torch.empty(shape, dtype=self.store, device=a.device))


def round_to_tf32(x: torch.Tensor, truncate: bool = False) -> torch.Tensor:
    """float32 ``x`` rounded to the nearest TF32 value (10 mantissa bits, ties to even), or with ``truncate``
    cut to it (toward zero), kept in float32: what a tensor core multiplies when handed float32 operands
    converted (cuBLAS) or not (Triton). Infinities and NaN stay as they are."""
    bits = x.float().contiguous().view(torch.int32)
    keep = (bits >> 13) & 1  # the last kept bit: ties go to the even one
    rounded = ((bits if truncate else bits + 0xFFF + keep) & ~0x1FFF).view(torch.float32)
    return torch.where(x.isfinite(), rounded, x.float()).view(x.shape)


def _scanned_states(
    steps: _Steps,
    r: Rounding,
    u: torch.Tensor,
    w: torch.Tensor,
    k_to_end: torch.Tensor,
    decay_end: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_rounded_states`` with the states entering the chunks from a parallel scan: each chunk's state map is
    affine, ``S' = M S + b`` (``M = diag(exp(G_C)) - K_end^T w``, ``b = K_end^T u``, in float32), and the maps
    of each sequence's chunks are composed in log2(chunks) rounds of a Hillis-Steele scan, as a kernel whose
    inter-chunk pass is a tree (AITER's segmented FlashKDA) composes them; the corrected values ``U`` then
    come from those states. The same algebra as the serial pass, rounded in other places. The working
    precision takes every chunk in one block, so the block is the whole plan."""
    plan, first, last, c0, HV, S_in, final, entering = steps.fields()
    K, V = S_in.shape[-2:]
    if first != 0 or last != len(plan.active) or c0 != 0:
        raise ValueError("the scanned state pass takes the whole plan in one block")
    M = -(r.dot(k_to_end) @ r.dot(w))
    M.diagonal(dim1=-2, dim2=-1).add_(decay_end.squeeze(-1))
    b = r.dot(k_to_end) @ r.dot(u)
    n, depth = len(plan.order), len(plan.active)
    # [sequence rank, step] -> the (chunk, head) rows of its chunk; steps past a sequence's end are identity maps.
    maps_M = torch.eye(K, dtype=M.dtype, device=M.device).repeat(n, depth, HV, 1, 1)
    maps_b = M.new_zeros(n, depth, HV, K, V)
    for j in range(depth):
        at = plan.offsets[j] * HV
        active = plan.active[j]
        maps_M[:active, j] = M[at : at + active * HV].reshape(active, HV, K, K)
        maps_b[:active, j] = b[at : at + active * HV].reshape(active, HV, K, V)
    reach = 1
    while reach < depth:  # inclusive scan: after it, step j holds the composition of steps 0..j
        later_M, later_b = maps_M[:, reach:], maps_b[:, reach:]
        earlier_M, earlier_b = maps_M[:, :-reach], maps_b[:, :-reach]
        composed_b = later_M @ earlier_b + later_b
        composed_M = later_M @ earlier_M
        maps_M = torch.cat([maps_M[:, :reach], composed_M], dim=1)
        maps_b = torch.cat([maps_b[:, :reach], composed_b], dim=1)
        reach *= 2
    h0 = entering.reshape(plan.active[0], HV, K, V) if depth else entering
    h0 = torch.cat([h0, h0.new_zeros(n - h0.shape[0], HV, K, V)]) if h0.shape[0] < n else h0
    for j in range(depth):
        at, active = plan.offsets[j] * HV, plan.active[j]
        start = h0[:active] if j == 0 else maps_M[:active, j - 1] @ h0[:active] + maps_b[:active, j - 1]
        S_in[at : at + active * HV] = r.state(start.reshape(active * HV, K, V))
    U = r(u - r.dot(w) @ r.dot(r(S_in)))
    for rank, sequence in enumerate(plan.order):
        count = sum(1 for a in plan.active if a > rank)
        if count == 0:  # no tokens: its final state is its initial state, set already
            continue
        final[sequence] = r.state(maps_M[rank, count - 1] @ h0[rank] + maps_b[rank, count - 1])
    return U, entering
