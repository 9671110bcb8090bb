"""fla-bwd-intra-tf32-parameter-gradients: fla-core 0.6.0, T128+128 bf16 H1/1 K32V64 sp reset h0:random vfirst S:bf16 x:large zeros:rows.

What goes wrong: FLA 0.6.0's chunk backward on NVIDIA: the gate parameters' gradients, sums over every token,
take the TF32 rounding of four float32 dots of the backward's intra-chunk kernel. On an H100 (2026-12-07, the
nightly profile at seed 5405) the case T2016x4 bf16 H1/1 K32V64 (softplus gate in the kernel, reset gates,
large inputs, bf16 random V-first states, zero rows; kda-529cde355035): dA_log 0.812 off a float64 gradient of
7.53 (11 %), 2.75 times its limits at FLA's declared TF32 design (the baseline 0.025 off), 1.56 times when
resumed at token 1008; ddt_bias rel-RMS 1.88 times (max-abs 0.75); every other gradient within 0.52 of its
limits. The same regimes at T128+128 (kda-edc9337323e8), on an H100 the same day: dA_log 0.136 off a float64
gradient of -7.648 (1.8 %; max-abs 2.05 times its limit, rel-RMS against the norm of its terms 4.09 times,
6.63 times the strict limits), ddt_bias within 0.73 of its limits and every other gradient within 0.47; with
IEEE dots (TRITON_F32_DEFAULT=ieee) dA_log 0.0091 off (0.12 %), 0.27 of its limits. The declared design names
Triton's default dots, but the baseline that models it rounds its own algebra's operands (the decayed keys and
queries to bf16, then TF32) and does not reproduce this; it is the precision of these dots, not the direction
of TF32's cut: rounded to nearest instead (in the interpreter) they cost more

Measured with kda-conformance (backend fla_chunk, check gradients) on cuda NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, fla-core 0.6.0: dA_log max-abs 0.136, rel-RMS 6.08e-05; ddt_bias max-abs 0.0249, rel-RMS 7.14e-05; dv max-abs 0.00441, rel-RMS 0.0022; dk max-abs 0.883, rel-RMS 0.00284; dg max-abs 0.0115, rel-RMS 3.75e-05; dh0 max-abs 9.63e-05, rel-RMS 0.00203; dq max-abs 0.108, rel-RMS 0.00266; dbeta max-abs 0.0382, rel-RMS 0.00142. The limits below are the suite's (docs/tolerance.md in kda-conformance), at the kernel's declared working precision (tf32-truncated dots); the library's own tests allow rel-RMS 0.005 (fla-org/flash-linear-attention tests/ops/test_kda.py test_chunk: assert_close('o', ...) and assert_close('ht', ...) at 0.005 against naive_recurrent_kda (float32); fla/utils/_testing.py get_err_ratio: RMS of the difference over RMS of the reference (with FLA_CI_ENV=1 a miss below 0.01, or with max-abs <= 0.3, only warns)).

The gradients are those of sum(o * d_o) + sum(final_state * d_final) with respect to each input, d_o and
d_final drawn from the case's seed, through the kernel's own autograd; the float64 truth is autograd through
the token loop below.

Upstream:
- not reported: to be filed with FLA with its standalone file (findings/test_fla_bwd_intra_tf32_parameter_gradients_fla.py), which fails on an H100, where the case passes with IEEE dots

Run: pytest test_fla_bwd_intra_tf32_parameter_gradients_fla.py (needs torch, pytest and fla-core). It fails while the kernel is wrong, passes once it is right, and skips naming what is missing.
Case (kda-conformance --case): {"beta_regime": "typical", "beta_sigmoid_in_kernel": true, "checkpoints": [], "dtype": "bf16", "gate": "softplus", "gate_dtype": "same", "gate_regime": "reset", "head_k_dim": 32, "head_v_dim": 64, "initial_state": "random", "input_layout": "contiguous", "input_scale": "large", "key_regime": "random", "key_rho": 0.0, "l2norm_in_kernel": false, "lower_bound": null, "num_heads": 1, "num_v_heads": 1, "packed": false, "pool_layout": "dense", "safe_gate": false, "scale": null, "seed": 89683, "seq_lens": [128, 128], "state_dtype": "bf16", "state_layout": "v_first", "tags": [], "zero_tokens": "rows"}
"""

import contextlib
import importlib
import itertools
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

CASE = SimpleNamespace(
    seq_lens=[128, 128],
    packed=False,
    num_heads=1,
    num_v_heads=1,
    head_k_dim=32,
    head_v_dim=64,
    dtype='bf16',
    state_dtype='bf16',
    gate='softplus',
    lower_bound=None,
    safe_gate=False,
    gate_regime='reset',
    key_regime='random',
    key_rho=0.0,
    beta_regime='typical',
    l2norm_in_kernel=False,
    beta_sigmoid_in_kernel=True,
    initial_state='random',
    state_layout='v_first',
    input_layout='contiguous',
    input_scale='large',
    pool_layout='dense',
    gate_dtype='same',
    zero_tokens='rows',
    checkpoints=[],
    scale=None,
    seed=89683,
    row_spans=((0, 0, 128), (1, 0, 128)),
    offsets=(0, 128, 256),
    total_tokens=256,
    num_seqs=2,
    gate_in_kernel=True,
    has_initial_state=True,
    state_v_first=True,
)

# ---- kda-conformance cases/seeded.py, verbatim ----------------------------------------
"""A case's tensors drawn from its seed, in plain torch.

This module imports nothing but torch, and reads a case only through attributes (``spec.seed``,
``spec.row_spans``...): ``kda_cases.materialize`` draws every case with it, and a standalone repro that
``kda-conformance findings --write-tests`` writes for an upstream report carries this module's source verbatim
with the case's fields as plain values, so it draws the very bits the suite judged, with torch alone.
"""

from typing import Any

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def draw(spec: Any) -> dict[str, Any]:
    """The case's tensors on the CPU, in their dtypes and contiguous: q, k, v, g, beta, A_log, dt_bias,
    initial_state (the case's state dtype and layout) and cu_seqlens (int64, packed cases only)."""
    gen = torch.Generator(device="cpu").manual_seed(spec.seed)
    B = 1 if spec.packed else spec.num_seqs
    T = spec.total_tokens if spec.packed else spec.seq_lens[0]
    H, HV, K, V = spec.num_heads, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
    q = torch.randn(B, T, H, K, generator=gen)
    k = _keys(spec, (B, T, H, K), gen)
    if not spec.l2norm_in_kernel:
        q = F.normalize(q, dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g, A_log, dt_bias = _gate(spec, (B, T, HV, K), gen)
    beta_raw = torch.randn(B, T, HV, generator=gen) + (6.0 if spec.beta_regime == "near_one" else 0.0)
    beta = beta_raw if spec.beta_sigmoid_in_kernel else torch.sigmoid(beta_raw)

    h0 = None
    if spec.has_initial_state:
        h0 = torch.randn(spec.num_seqs, HV, K, V, generator=gen)
        if spec.initial_state == "large":
            h0 = h0 * 30.0
        if spec.state_v_first:
            h0 = h0.transpose(-1, -2).contiguous()
        h0 = h0.to(DTYPES[spec.state_dtype])

    q, k, v = _scaled(spec, q, k, v, gen)  # drawn last: a typical case's bits are what they were
    cu = torch.tensor(spec.offsets, dtype=torch.long) if spec.packed else None

    dtype = DTYPES[spec.dtype]
    q, k, v = (x.to(dtype) for x in (q, k, v))
    # g and beta in the tokens' dtype, or their own (float32 beside bf16 tokens, as servers' gate kernels hand them)
    gate_dtype = dtype if getattr(spec, "gate_dtype", "same") == "same" else DTYPES[spec.gate_dtype]
    g, beta = g.to(gate_dtype), beta.to(gate_dtype)
    if getattr(spec, "zero_tokens", "none") == "rows":  # drawn last: the other tensors' bits are as they were
        q, k, v = _zero_rows(q, k, v, gen)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias, "initial_state": h0,
            "cu_seqlens": cu}  # fmt: skip


# Upstream gradients are drawn from a stream of their own, so that a case's inputs keep their bits.
UPSTREAM_STREAM = 0x6772616473


def upstream(spec: Any) -> dict[str, Any]:
    """The upstream gradients a backward pass of the case is called with, on the CPU: ``d_o`` (of the outputs,
    ``[B, T, HV, V]`` in the tokens' dtype) and ``d_final`` (of the final states, in the state's dtype and
    layout), unit Gaussians."""
    gen = torch.Generator(device="cpu").manual_seed(spec.seed ^ UPSTREAM_STREAM)
    B = 1 if spec.packed else spec.num_seqs
    T = spec.total_tokens if spec.packed else spec.seq_lens[0]
    HV, K, V = spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
    d_o = torch.randn(B, T, HV, V, generator=gen)
    d_final = torch.randn(spec.num_seqs, HV, K, V, generator=gen)
    if spec.state_v_first:
        d_final = d_final.transpose(-1, -2).contiguous()
    return {"d_o": d_o.to(DTYPES[spec.dtype]), "d_final": d_final.to(DTYPES[spec.state_dtype])}


def _zero_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """About one token in 16 (and at least one) made exactly zero, all heads: a third of them in q, k and v (a
    zero hidden state's projection, a zero-filled buffer's row), a third in k only, a third in q only."""
    B, T = q.shape[:2]
    picked = torch.rand(B, T, generator=gen) < 1 / 16
    picked[torch.randint(B, (1,), generator=gen), torch.randint(T, (1,), generator=gen)] = True
    kind = torch.randint(3, (B, T), generator=gen)  # 0: q, k and v; 1: k only; 2: q only

    def zeroed(x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        return x.masked_fill((picked & where).view(B, T, 1, 1), 0.0)

    return zeroed(q, kind != 1), zeroed(k, kind != 2), zeroed(v, kind == 0)


def _keys(spec: Any, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    k = torch.randn(shape, generator=gen)
    if spec.key_regime == "correlated":
        # AR(1) along time per sequence: k_t = rho k_{t-1} + sqrt(1 - rho^2) noise.
        rho = spec.key_rho
        out = torch.empty_like(k)
        for _, start, end in spec.row_spans:
            prev = None
            for t in range(start, end):
                prev = k[:, t] if prev is None else rho * prev + (1 - rho * rho) ** 0.5 * k[:, t]
                out[:, t] = prev
        k = out
    elif spec.key_regime == "repeated":
        # Runs of 16 identical tokens, the pattern that broke FlashKDA's fp16 inverse.
        index = torch.arange(shape[1]) // 16 * 16
        k = k[:, index]
    if not spec.l2norm_in_kernel:
        # The delta rule is stable for unit-norm keys; normalize here when the kernel does not.
        k = F.normalize(k, dim=-1)
    return k


def _gate(spec: Any, shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, Any, Any]:
    HV, K = spec.num_v_heads, spec.head_k_dim
    noise = torch.randn(shape, generator=gen)
    A_log = dt_bias = None
    if not spec.gate_in_kernel:  # a precomputed gate (GATES in cases/case.py)
        if spec.gate_regime == "weak":
            g = -torch.rand(shape, generator=gen) * 0.01
        elif spec.gate_regime == "strong":
            g = -3.0 - 2.0 * torch.rand(shape, generator=gen)
        else:
            g = F.logsigmoid(noise)
            if spec.gate_regime == "reset":
                g = torch.where(_reset_tokens(shape, gen), torch.full_like(g, -30.0), g)
        if spec.lower_bound is not None:
            # A precomputed gate under safe_gate must respect the bound itself.
            g = g.clamp(min=spec.lower_bound)
        return g, None, None
    A_log = torch.log(torch.empty(HV).uniform_(1.0, 16.0, generator=gen))
    dt_bias = 0.1 * torch.randn(HV * K, generator=gen)
    # Raw pre-activations: a negative shift makes softplus / sigmoid tiny (decay near 1,
    # weak), a positive one saturates them (strong decay, at the lower bound if any).
    shift = {"typical": 0.0, "weak": -8.0, "strong": 4.0, "reset": 0.0}[spec.gate_regime]
    raw = noise + shift
    if spec.gate_regime == "reset":
        # Saturate the activation: the strongest decay the gate form allows (lower_bound, or exp(-huge)).
        raw = torch.where(_reset_tokens(shape, gen), torch.full_like(raw, 30.0), raw)
    return raw, A_log, dt_bias


def _reset_tokens(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Hard resets: about one token in 32 (all heads and keys of it) forgets almost everything."""
    B, T = shape[0], shape[1]
    hits = torch.rand(B, T, generator=gen) < 1.0 / 32
    return hits.view(B, T, *([1] * (len(shape) - 2))).expand(shape)


def _scaled(
    spec: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The case's magnitude regime (``INPUT_SCALES``): v, and q and k where the kernel normalizes them (the
    suite's unit keys keep the delta rule stable otherwise, and unit queries keep |o| about max |v|:
    representable in fp16), scaled x10 to x100 (``large``), or a few of their tokens and channels x100 to
    x1000 (``outliers``). Queries scaled beside values multiply into the output: on the H200 the fp16
    baseline of T8191+8191 (K = V = 256, weak gates, outliers, no in-kernel l2norm) was not finite."""
    if spec.input_scale == "typical":
        return q, k, v
    scaled = [v, q, k] if spec.l2norm_in_kernel else [v]
    out = []
    for x in scaled:
        if spec.input_scale == "large":
            x = x * 10 ** (1 + float(torch.rand((), generator=gen)))
        else:
            T, D = x.shape[1], x.shape[-1]
            factor = torch.ones(T, D)
            tokens = torch.randperm(T, generator=gen)[: max(1, T // 64)]
            channels = torch.randperm(D, generator=gen)[: max(1, D // 32)]
            factor[tokens] = 10 ** (2 + torch.rand(len(tokens), 1, generator=gen))
            # A channel's outliers where they cross an outlier token: the larger factor, not their product.
            factor[:, channels] = torch.maximum(
                factor[:, channels], 10 ** (2 + torch.rand(len(channels), generator=gen))
            )
            x = x * factor[None, :, None, :]
        out.append(x)
    if not spec.l2norm_in_kernel:
        return q, k, out[0]
    return out[1], out[2], out[0]


def behind_filler(
    tokens: dict[str, torch.Tensor], initial_state: Any, cu_seqlens: Any, filler: int
) -> tuple[dict[str, torch.Tensor], Any, torch.Tensor]:
    """A case's sequences packed behind one sequence of ``filler`` zero tokens (zero is a valid token of every
    gate form and layout), so that they start ``filler`` rows into every token tensor: ``tokens`` (q k v g beta,
    ``[B, T, ...]``; an unpacked case's rows are packed one after another) joined and contiguous, a zero
    initial state for the filler where the case has states, and the batch's cu_seqlens (int32, as servers
    pass it; ``cu_seqlens`` None for an unpacked case of equal rows). kda-conformance's offsets check runs
    kernels so, to put a case past 2^31 elements."""
    first = next(iter(tokens.values()))
    B, T = first.shape[:2]
    if cu_seqlens is None:
        cu_seqlens = torch.arange(B + 1, device=first.device) * T
    rows = {name: x.reshape(1, B * T, *x.shape[2:]) for name, x in tokens.items()}
    joined = {name: torch.cat([x.new_zeros((1, filler, *x.shape[2:])), x], dim=1) for name, x in rows.items()}
    if initial_state is not None:
        initial_state = torch.cat([initial_state.new_zeros((1, *initial_state.shape[1:])), initial_state])
    ends = cu_seqlens.to(device=first.device, dtype=torch.int32) + filler
    return joined, initial_state, torch.cat([ends.new_zeros(1), ends])


def laid_out(layout: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``q k v g beta`` (contiguous, ``[B, T, heads, ...]``) with the same values in the memory layout a
    server hands a kernel (``INPUT_LAYOUTS`` in cases/case.py): ``fused``, q, k and v as views of one
    ``[B, T, H*K + H*K + HV*V]`` buffer (the split of a fused qkv projection) and g, beta of one
    ``[B, T, HV*K + HV]`` buffer; ``head_major``, each a transposed view of a ``[B, heads, T, ...]`` tensor."""
    if layout == "contiguous":
        return tensors
    if layout == "head_major":
        return tuple(x.transpose(1, 2).contiguous().transpose(1, 2) for x in tensors)
    if layout != "fused":
        raise ValueError(f"input_layout={layout!r} is not one of contiguous, fused, head_major")
    q, k, v, g, beta = tensors
    return (*_views_of_one_buffer(q, k, v), *_views_of_one_buffer(g, beta))


def _views_of_one_buffer(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors copied side by side along the last axis of one ``[B, T, sum of widths]`` buffer, each
    returned as a view of its slice (its token stride the buffer's width)."""
    B, T = tensors[0].shape[:2]
    widths = [x[0, 0].numel() for x in tensors]
    buffer = torch.empty(B, T, sum(widths), dtype=tensors[0].dtype, device=tensors[0].device)
    views, start = [], 0
    for x, width in zip(tensors, widths, strict=True):
        view = buffer[..., start : start + width].unflatten(-1, x.shape[2:]) if x.dim() > 2 else buffer[..., start]
        view.copy_(x)
        views.append(view)
        start += width
    return tuple(views)


# ---- kda-conformance reference/preprocess.py, verbatim ----------------------------------------
"""Input preprocessing shared by the reference and every backend that needs it.

Each function follows fla-core 0.6.0 (``fla/ops/kda/gate.py``, ``chunk.py``) and
computes in the dtype of its input, so the reference calls it on float64 tensors
and a working-precision baseline on float32 ones.
"""


import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dimension, as ``use_qk_l2norm_in_kernel`` does."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def beta_activation(beta: torch.Tensor, sigmoid: bool) -> torch.Tensor:
    """``sigmoid(beta)`` when the kernel applies it (``use_beta_sigmoid_in_kernel``), else ``beta``."""
    return torch.sigmoid(beta) if sigmoid else beta


def gate_activation(
    g: torch.Tensor,
    *,
    in_kernel: bool,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """The per-key log decay from the gate input ``g`` of shape ``[..., HV, K]``.

    Not ``in_kernel``: ``g`` already is the log decay. In kernel, with
    ``lower_bound`` None: ``-exp(A_log) * softplus(g + dt_bias)``; with a lower
    bound ``lb``: ``lb * sigmoid(exp(A_log) * (g + dt_bias))`` (``A_log`` may then
    be None: ``lb * sigmoid(g + dt_bias)``). The form follows ``lower_bound is
    not None``, not ``safe_gate``.
    """
    if not in_kernel:
        return g
    HV, K = g.shape[-2], g.shape[-1]
    x = g
    if dt_bias is not None:
        x = x + dt_bias.to(g.dtype).reshape(HV, K)
    if lower_bound is None:
        if A_log is None:
            raise ValueError("A_log is required for the softplus gate (lower_bound=None)")
        rate = torch.exp(A_log.to(g.dtype)).reshape(HV, 1)
        return -rate * F.softplus(x, beta=1.0, threshold=SOFTPLUS_THRESHOLD)
    if A_log is not None:
        x = torch.exp(A_log.to(g.dtype)).reshape(HV, 1) * x
    return lower_bound * torch.sigmoid(x)


# ---- kda-conformance reference/plain.py, verbatim ----------------------------------------
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

# ---- the kernel, called as its server calls it ----------------------------------------

LIBRARIES = {'fla': ('fla-core', 'pip install fla-core==0.6.0', '')}


def needs(module, source_variable=None):
    """``module`` imported, or the test skipped naming the package that is missing. A source tree named
    by ``source_variable`` is put first on the path."""
    top = module.split(".")[0]
    name, install, variable = LIBRARIES.get(top, (top, "", ""))
    tree = os.environ.get(source_variable or variable or "")
    if tree and tree not in sys.path:
        sys.path.insert(0, tree)
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = (exc.name or module).split(".")[0]
        if missing == top:
            pytest.skip(f"needs {name}" + (f" ({install})" if install else ""))
        pytest.skip(f"needs {missing}, which {name} imports (pip install {missing})")



def call(q, k, v, g, beta, initial_state, cu_seqlens, **kwargs):
    os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "1"  # the Triton path itself, not a dispatch to FlashKDA
    kda = needs("fla.ops.kda")  # skips naming what is missing: fla-core, or a module it imports
    return kda.chunk_kda(
        q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, output_final_state=True, safe_gate=False, chunk_size=64, **kwargs
    )



def where_it_runs():
    if not torch.cuda.is_available():
        pytest.skip('needs a GPU (the finding was measured on cuda NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, fla-core 0.6.0); torch sees none')
    return "cuda"

# ---- kda-conformance judging/metrics.py, verbatim ----------------------------------------
def rms_past_one_ulp(err: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """The RMS of the errors ``err`` (of a result of ``dtype`` against the float64 ``want``), its largest error
    counted less one ulp of ``dtype`` at that element's exact value: a kernel that returns one element as the
    other neighbour of its exact value (FLA's chunk backward, dg 8.25 for 8.1877 in bf16 on a 5-token sequence,
    99.99 % of that part's squared error) has rounded it, which a small part's RMS makes look large and no
    kernel can be asked to avoid; an error spread over the elements keeps all but one element's worth
    (kda-conformance docs/tolerance.md, "one ulp at one element"). Standalone files carry it verbatim: it uses
    torch and math only."""
    if not err.numel():
        return 0.0
    total = float(err.pow(2).sum())
    worst = int(err.argmax())
    largest = float(err.flatten()[worst])
    if not (math.isfinite(total) and dtype.is_floating_point):
        return math.sqrt(total / err.numel())
    exact = want.flatten()[worst].abs().to(dtype)
    ulp = float(exact.nextafter(torch.tensor(math.inf, dtype=dtype, device=exact.device))) - float(exact)
    if not math.isfinite(ulp):  # an exact value at or past the dtype's largest finite one: nothing is forgiven
        ulp = 0.0
    forgiven = max(largest - ulp, 0.0)
    return math.sqrt(max(total - largest**2 + forgiven**2, 0.0) / err.numel())


# Limits: limit = min(cap, max(factor x baseline, floor)), the baseline the same case through a plain PyTorch
# chunked KDA at working precision; see kda-conformance docs/tolerance.md.
# dA_log: max-abs limit 0.06662 (set by the baseline: baseline 0.0167 x 4, floor 0.0206, cap 140); rel-RMS limit 1.485e-05 (set by the baseline: baseline 7.42e-06 x 2)
# ddt_bias: max-abs limit 0.08489 (set by the baseline: baseline 0.0212 x 4, floor 0.00667, cap 21.4); rel-RMS limit 9.72e-05 (set by the baseline: baseline 4.86e-05 x 2)
# dv: max-abs limit 0.02314 (set by the baseline: baseline 0.00579 x 4, floor 0.00685, cap 0.109); rel-RMS limit 0.004694 (set by the baseline: baseline 0.00235 x 2)
# dk: max-abs limit 5.822 (set by the baseline: baseline 1.46 x 4, floor 1.57, cap 25.1); rel-RMS limit 0.006237 (set by the baseline: baseline 0.00312 x 2)
# dg: max-abs limit 0.07293 (set by the baseline: baseline 0.0182 x 4, floor 0.0177, cap 20.8); rel-RMS limit 9.358e-05 (set by the baseline: baseline 4.68e-05 x 2)
# dh0: max-abs limit 0.000808 (set by the baseline: baseline 0.000202 x 4, floor 0.000178, cap 0.00284); rel-RMS limit 0.005581 (set by the baseline: baseline 0.00279 x 2)
# dq: max-abs limit 0.7583 (set by the baseline: baseline 0.19 x 4, floor 0.188, cap 3); rel-RMS limit 0.007383 (set by the baseline: baseline 0.00369 x 2)
# dbeta: max-abs limit 0.4632 (set by the baseline: baseline 0.116 x 4, floor 0.149, cap 2.39); rel-RMS limit 0.005837 (set by the baseline: baseline 0.00292 x 2)
LIMITS = {'dA_log': {'max_abs': 0.06662488759719665, 'rel_rms': 1.4849685029853927e-05}, 'ddt_bias': {'max_abs': 0.08488613997454664, 'rel_rms': 9.719694831572282e-05}, 'dv': {'max_abs': 0.02314036459696389, 'rel_rms': 0.004694409205844546}, 'dk': {'max_abs': 5.821749284721591, 'rel_rms': 0.006236939202513667}, 'dg': {'max_abs': 0.07292683969509817, 'rel_rms': 9.358389249014716e-05}, 'dh0': {'max_abs': 0.0008079978925758791, 'rel_rms': 0.005580976368768535}, 'dq': {'max_abs': 0.7582912359357579, 'rel_rms': 0.0073832772673031784}, 'dbeta': {'max_abs': 0.4631660634594077, 'rel_rms': 0.005836665997254496}}
LIBRARY_TOLERANCE = {}  # rel-RMS, from the library's own tests
MEASURED = {'dA_log': {'max_abs': 0.13637178942272232, 'rel_rms': 6.079196792001918e-05, 'nonfinite': 0}, 'ddt_bias': {'max_abs': 0.02486727865936067, 'rel_rms': 7.136569281772202e-05, 'nonfinite': 0}, 'dv': {'max_abs': 0.004414150139261608, 'rel_rms': 0.002201519808220445, 'nonfinite': 0}, 'dk': {'max_abs': 0.8831478837796709, 'rel_rms': 0.002835982649118641, 'nonfinite': 0}, 'dg': {'max_abs': 0.01145445906478626, 'rel_rms': 3.752978266610967e-05, 'nonfinite': 0}, 'dh0': {'max_abs': 9.626061549631443e-05, 'rel_rms': 0.0020252893144547114, 'nonfinite': 0}, 'dq': {'max_abs': 0.10773383459906682, 'rel_rms': 0.002658649878382462, 'nonfinite': 0}, 'dbeta': {'max_abs': 0.03820839721529978, 'rel_rms': 0.0014201379343995028, 'nonfinite': 0}}  # when written, on cuda NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, fla-core 0.6.0
TINY = torch.finfo(torch.float64).tiny
TOKENS = ("q", "k", "v", "g", "beta")


def first_bad(name, bad):
    at = bad.nonzero()[0].tolist()
    if name in ("final_state", "dh0"):
        return f"(sequence, head) {tuple(at[:2])}"
    if name in ("dA_log", "ddt_bias"):
        return f"index {tuple(at)}"
    return f"(row, token, head) {tuple(at[:3])}"


def held(name, got, want, problems, lines, scale=0.0):
    # got against the float64 want: a line of its errors, and a problem for each limit it passes. Rel-RMS is
    # over the RMS of want, or over scale where larger.
    if got is None or tuple(got.shape) != tuple(want.shape):
        shape = None if got is None else list(got.shape)
        problems.append(f"{name}: shape {shape} != {list(want.shape)}")
        return
    want = want.detach()
    err = (got.detach().double().cpu() - want).abs()
    nonfinite = int((~got.isfinite()).sum())
    ref = max(float(want.pow(2).mean().sqrt()) if want.numel() else 0.0, scale, TINY)
    max_abs = math.inf if nonfinite else (float(err.max()) if err.numel() else 0.0)
    rel_rms = math.inf if nonfinite else (rms_past_one_ulp(err, want, got.dtype) / ref if err.numel() else 0.0)
    if name not in LIMITS:  # a crash's finding: the call runs, and its result is whole and finite
        problems += [f"{name}: {nonfinite} non-finite values"] if nonfinite else []
        lines.append(f"{name}: max-abs {max_abs:.3e}, rel-RMS {rel_rms:.3e} (no limits recorded)")
        return
    limit, then = LIMITS[name], MEASURED[name]
    line = f"{name}: max-abs {max_abs:.3e} (limit {limit['max_abs']:.3e}), rel-RMS {rel_rms:.3e}"
    line += f" (limit {limit['rel_rms']:.3e}); when written {then['max_abs']:.3e}, {then['rel_rms']:.3e}"
    if name in LIBRARY_TOLERANCE:
        own = LIBRARY_TOLERANCE[name]
        line += f"; the library's own tolerance {own:g}: {rel_rms / own:.3g}x"
    lines.append(line)
    if nonfinite:
        problems.append(f"{name}: {nonfinite} non-finite values")
    for metric, value in (("max_abs", max_abs), ("rel_rms", rel_rms)):
        if not value <= limit[metric]:
            problem = f"{name}: {metric} {value:.3e} > limit {limit[metric]:.3e}"
            if metric == "max_abs":
                problem += ", first at " + first_bad(name, (err > limit["max_abs"]) | ~got.detach().cpu().isfinite())
            problems.append(problem)


# The gradient of each input, by the name reports give it.
GRADIENT_OF = {'q': 'dq', 'k': 'dk', 'v': 'dv', 'g': 'dg', 'beta': 'dbeta', 'initial_state': 'dh0', 'A_log': 'dA_log', 'dt_bias': 'ddt_bias'}
# The gate's gradients sum terms that cancel: their rel-RMS is taken against the RMS of those terms (|q dq| and
# |k dk| times the gate's derivative, token by token) where larger than their own, computed by kda-conformance on
# these very inputs (its docs/tolerance.md, "Gradients").
TERM_RMS = {'dg': 8.09616739320996, 'ddt_bias': 129.53867829135936, 'dA_log': 2243.2455676542786}


def leaf(x):
    # A copy with x's strides that requires a gradient.
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x).requires_grad_()


def test_fla_bwd_intra_tf32_parameter_gradients():
    device = where_it_runs()
    x = draw(CASE)  # the suite's inputs, bit for bit, on the CPU
    up = upstream(CASE)  # the gradients of the loss sum(o * d_o) + sum(final_state * d_final)
    kwargs = dict(
        scale=None,
        use_qk_l2norm_in_kernel=False,
        use_beta_sigmoid_in_kernel=True,
        use_gate_in_kernel=True,
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=None,
        state_v_first=True,
    )
    wrt = [n for n in GRADIENT_OF if x.get(n) is not None and (CASE.gate_in_kernel or n not in ("A_log", "dt_bias"))]
    # The float64 truth: autograd through the plain token loop.
    exact = {n: x[n].double().requires_grad_() for n in wrt}
    o64, final64 = kda_token_loop(
        *(exact[n] for n in TOKENS), initial_state=exact.get("initial_state"), cu_seqlens=x["cu_seqlens"],
        **dict(kwargs, A_log=exact.get("A_log", x["A_log"]), dt_bias=exact.get("dt_bias", x["dt_bias"])),
    )
    loss = (o64 * up["d_o"].double()).sum() + (final64 * up["d_final"].double()).sum()
    want = dict(zip(wrt, torch.autograd.grad(loss, [exact[n] for n in wrt])))
    # The kernel's own backward, on its inputs as the suite hands them (laid out; the state widened to fp32).
    moved = {name: None if t is None else t.to(device) for name, t in x.items()}
    given = dict(zip(TOKENS, laid_out(CASE.input_layout, *(moved[n] for n in TOKENS))))
    given.update(initial_state=None if moved["initial_state"] is None else moved["initial_state"].float())
    given.update(A_log=moved["A_log"], dt_bias=moved["dt_bias"])
    given.update({n: leaf(given[n]) for n in wrt})
    kwargs.update(A_log=given["A_log"], dt_bias=given["dt_bias"])
    with contextlib.nullcontext():
        o, final = call(*(given[n] for n in TOKENS), given["initial_state"], moved["cu_seqlens"], **kwargs)
    pairs = [(t, d.to(device=device, dtype=t.dtype)) for t, d in ((o, up["d_o"]), (final, up["d_final"]))]
    pairs = [(t, d) for t, d in pairs if t.requires_grad]
    assert pairs, "the kernel's outputs carry no autograd graph"
    got = torch.autograd.grad(
        [t for t, _ in pairs], [given[n] for n in wrt], [d for _, d in pairs], materialize_grads=True
    )
    problems, lines = [], []
    for n, grad in zip(wrt, got):
        if n == "initial_state":  # in the state's own dtype, as its pool holds it
            grad = grad.to(x["initial_state"].dtype)
        held(GRADIENT_OF[n], grad, want[n], problems, lines, TERM_RMS.get(GRADIENT_OF[n], 0.0))
    print("\n".join(lines))
    assert not problems, "\n".join(problems + lines)
