"""servers-chunk-states-offset-int32: vLLM vllm 0.33.0 (KDA_VLLM_SRC), T300 bf16 H16/16 K128V128 lb-1 vfirst.

What goes wrong: vLLM 0.33.0's KDA chunk kernel gives wrong outputs or faults once its per-chunk states
(chunks x H x K x V elements, all sequences of the batch together) pass 2^31 elements: on an H100, a T300 bf16
H16/16 K128V128 sequence packed behind a sequence of zero tokens passes within its budgets behind 523,888
tokens of filler (8,191 chunks, 2,147,221,504 state elements) and faults with an illegal memory access behind
524,288 (8,197 chunks, past 2^31) and 524,688; behind 1,048,176 tokens it runs and its outputs are wrong from
the first token on (rel-RMS 0.917, 122 times the limit; max-abs 41.5 times). fla-core 0.6.0's chunk kernel
passes the same case behind 524,288 and 1,048,176 tokens. The state tensor is twice as large as q at K = V =
128 (T x H x 256 against T x H x 128 elements), so it passes 2^31 at half the tokens that 32-bit offsets into
q would need

Measured with kda-conformance (backend vllm_chunk, check offsets_past_2_31) on cuda NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, vLLM vllm 0.33.0 (KDA_VLLM_SRC): o max-abs 0.0625, rel-RMS 0.925; final_state max-abs 0.00409, rel-RMS 0.00255. The limits below are the suite's (docs/tolerance.md in kda-conformance), at the kernel's declared working precision (tf32-truncated dots); the library's own tests allow rel-RMS 0.005 (vllm-project/vllm tests/models/kimi_k3/test_kda.py: RMS of the difference over RMS of a float32 reference < 0.005, lengths up to 8192).

The case runs packed behind 1048176 tokens of zeros (FILLER), so that its first token lies past 2^31 elements
of the token tensors (and of the per-chunk states a chunk kernel keeps); the truth is the case's own, and its
rows are judged where they land. A 32-bit offset wraps there.

Upstream:
- not reported: to be filed with vLLM and SGLang, each with its standalone file (findings/test_servers_chunk_states_offset_int32_vllm.py, findings/test_servers_chunk_states_offset_int32_sglang.py)

Run: pytest test_servers_chunk_states_offset_int32_vllm.py (needs torch, pytest and vLLM; KDA_VLLM_SRC=DIR loads it from a source tree). It fails while the kernel is wrong, passes once it is right, and skips naming what is missing.
Case (kda-conformance --case): {"beta_regime": "typical", "beta_sigmoid_in_kernel": true, "checkpoints": [], "dtype": "bf16", "gate": "lower_bound", "gate_dtype": "same", "gate_regime": "typical", "head_k_dim": 128, "head_v_dim": 128, "initial_state": "none", "input_layout": "contiguous", "input_scale": "typical", "key_regime": "random", "key_rho": 0.0, "l2norm_in_kernel": false, "lower_bound": -1.0, "num_heads": 16, "num_v_heads": 16, "packed": true, "pool_layout": "dense", "safe_gate": true, "scale": null, "seed": 2031, "seq_lens": [300], "state_dtype": "fp32", "state_layout": "v_first", "tags": [], "zero_tokens": "none"}
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
    seq_lens=[300],
    packed=True,
    num_heads=16,
    num_v_heads=16,
    head_k_dim=128,
    head_v_dim=128,
    dtype='bf16',
    state_dtype='fp32',
    gate='lower_bound',
    lower_bound=-1.0,
    safe_gate=True,
    gate_regime='typical',
    key_regime='random',
    key_rho=0.0,
    beta_regime='typical',
    l2norm_in_kernel=False,
    beta_sigmoid_in_kernel=True,
    initial_state='none',
    state_layout='v_first',
    input_layout='contiguous',
    input_scale='typical',
    pool_layout='dense',
    gate_dtype='same',
    zero_tokens='none',
    checkpoints=[],
    scale=None,
    seed=2031,
    row_spans=((0, 0, 300),),
    offsets=(0, 300),
    total_tokens=300,
    num_seqs=1,
    gate_in_kernel=True,
    has_initial_state=False,
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

LIBRARIES = {}


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

# ---- kda-conformance kernels/server_stubs.py, verbatim ----------------------------------------
"""Loading a server's copy of the KDA kernels from its source tree without installing the server: the
packages between the tree's root and its ``kda.py`` registered bare (their ``__init__`` would import the whole
server), and the few server modules the kernels import from outside their folder stubbed with what they use
(``STUBS``).

It imports nothing of kda-conformance: a standalone repro file for a server's kernels
(conformance/repro/standalone_finding.py) carries this module verbatim, so that its maintainer can run it on
a source checkout as the suite does. The suite's side (which trees exist, their environment variables, the
interpreter) is kernels/vendored_trees.py.
"""


import contextlib
import importlib
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch


class StubGap(AttributeError):
    """The kernels asked a stub of the server's modules for something the loader does not provide: the
    loader's gap, not the kernel's error. An AttributeError, so ``hasattr`` and ``from m import x`` behave as
    they would."""


class _Stub(types.ModuleType):
    """A stub module of the server: what the loader provides, and a StubGap naming anything else."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        raise StubGap(f"the stub of {self.__name__} has no {name} (the loader's gap, not the kernel's)")


def _triton_utils() -> dict[str, object]:
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    return {"triton": triton, "tl": tl, "tldevice": tldevice, "HAS_TRITON": True}


def _math_utils() -> dict[str, object]:
    return {
        "cdiv": lambda a, b: -(a // -b),
        "next_power_of_2": lambda n: 1 << (int(n) - 1).bit_length() if n > 0 else 1,
        # vLLM's own constant (vllm/utils/math_utils.py), not 1 / ln 2: its gates' log2 scaling uses it.
        "RCP_LN2": 1.4426950216,
    }


class _Capability(tuple):
    """vLLM's ``DeviceCapability``: ``(major, minor)`` that compares as a tuple and says ``to_int()``."""

    @property
    def major(self) -> int:
        return self[0]

    @property
    def minor(self) -> int:
        return self[1]

    def to_int(self) -> int:
        return self[0] * 10 + self[1]

    def as_version_str(self) -> str:
        return f"{self[0]}.{self[1]}"


class _Platform:
    """What the kernels ask of vLLM's ``current_platform`` (vllm/platforms/interface.py); anything else is a
    StubGap naming it."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        raise StubGap(f"the stub of vllm.platforms.current_platform has no {name} (the loader's gap)")

    def get_device_capability(self, device_id: int = 0) -> _Capability | None:
        if not torch.cuda.is_available():
            return None
        return _Capability(torch.cuda.get_device_capability(device_id))

    def has_device_capability(self, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        current = self.get_device_capability(device_id)
        if current is None:
            return False
        return tuple(current) >= tuple(capability) if isinstance(capability, tuple) else current.to_int() >= capability

    def is_device_capability(self, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        current = self.get_device_capability(device_id)
        if current is None:
            return False
        return tuple(current) == tuple(capability) if isinstance(capability, tuple) else current.to_int() == capability

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        current = self.get_device_capability(device_id)
        return current is not None and current.to_int() // 10 == capability // 10

    def is_arch_support_pdl(self) -> bool:
        return False  # programmatic dependent launch: a scheduling choice, not the kernels' numerics

    def get_device_name(self, device_id: int = 0) -> str:
        return torch.cuda.get_device_name(device_id) if torch.cuda.is_available() else "cpu"

    def num_compute_units(self, device_id: int = 0) -> int:
        return torch.cuda.get_device_properties(device_id).multi_processor_count

    def is_cuda_alike(self) -> bool:
        return torch.cuda.is_available()

    def is_cuda(self) -> bool:
        return torch.cuda.is_available() and torch.version.hip is None

    def is_rocm(self) -> bool:
        return torch.cuda.is_available() and torch.version.hip is not None

    def is_xpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return not torch.cuda.is_available()


def _async_tensor_h2d(
    data: object,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM's host-to-device copy of host-built metadata (its chunk indices), without the pinned staging."""
    host = torch.as_tensor(data, dtype=dtype or (out.dtype if out is not None else None))
    if out is not None:
        return out.copy_(host, non_blocking=True)
    return host.to(device=device, non_blocking=True)


class _CustomOp(torch.nn.Module):
    """vLLM's ``CustomOp``: only its ``register`` decorator is used by the kernel files."""

    @classmethod
    def register(cls, name: str) -> Callable[[type], type]:
        return lambda op: op


def _sglang_utils() -> dict[str, object]:
    platform = _Platform()
    return {
        **{k: v for k, v in _math_utils().items() if k != "RCP_LN2"},
        "is_cpu": platform.is_cpu,
        "is_cuda": platform.is_cuda,
        "is_hip": platform.is_rocm,
        "is_npu": lambda: False,
        "cpu_has_amx_support": lambda: False,
        "torch_release": tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]),
    }


# Modules outside the kernels' folder that they import, and what is provided in their place.
STUBS: dict[str, Callable[[], dict[str, object]]] = {
    "vllm.triton_utils": _triton_utils,
    "vllm.utils.math_utils": _math_utils,
    "vllm.platforms": lambda: {"current_platform": _Platform()},
    "vllm.model_executor.custom_op": lambda: {"CustomOp": _CustomOp},
    "vllm.utils.gpu_sync_debug": lambda: {"gpu_sync_allowed": contextlib.nullcontext},
    "vllm.utils.torch_utils": lambda: {"async_tensor_h2d": _async_tensor_h2d},
    "vllm.utils.platform_utils": lambda: {"num_compute_units": _Platform().num_compute_units},
    "sglang.srt.utils": _sglang_utils,
    "sglang.srt.utils.common": _sglang_utils,
    # SGLang 0.5.23's gated norm asks for the JIT's CUDA arch and programmatic dependent launch: neither here
    "sglang.kernels.jit.utils": lambda: {
        "get_jit_cuda_arch": lambda *a, **k: None,
        "is_arch_support_pdl": lambda *a, **k: False,
    },
}


def module_file(root: Path, module: str) -> Path | None:
    """Where ``module`` lives in the tree (a file, or a package's ``__init__.py``), or None."""
    path = root.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _register_parents(root: Path, dotted: str) -> None:
    """Every package above ``dotted``, bare (its ``__init__`` never runs: it would import the whole server),
    where not registered already."""
    parts = dotted.split(".")[:-1]
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*parts[:depth]))]
            sys.modules[name] = package


def register_tree(root: Path, package: str, modules: tuple[str, ...], bare: tuple[str, ...] = ()) -> None:
    """Bare packages from the tree's root down to each kernel folder it may have (``modules``: one copy may
    import another's modules) and to each of ``bare``, and the stubs of the server whose top package is
    ``package``."""
    for module in modules:
        _register_parents(root, module)
    for name in bare:
        _register_parents(root, f"{name}.x")  # the package itself, bare, with its parents
    for name, provide in STUBS.items():
        if name.split(".")[0] != package or name in sys.modules:
            continue
        _register_parents(root, name)
        stub = _Stub(name)
        stub.__dict__.update(provide())
        stub.__path__ = []  # a package too, in case the kernels import a submodule of it
        sys.modules[name] = stub


def import_kda(root: Path, package: str, modules: tuple[str, ...], bare: tuple[str, ...] = ()) -> types.ModuleType:
    """The first of ``modules`` (where the server's ``kda.py`` lives, newest layout first) that the tree at
    ``root`` holds, imported with its packages bare and the server's modules stubbed (:func:`register_tree`).
    ImportError where the tree holds none of them."""
    found = [m for m in modules if module_file(root, m) is not None]
    if not found:
        raise ImportError(f"{root} holds none of {', '.join(modules)}")
    register_tree(root, package, modules, bare)
    return importlib.import_module(found[0])


# ---- kda-conformance kernels/server_layers.py, verbatim ----------------------------------------
"""How the servers' KDA layers call their vendored copies of FLA's chunk kernels, read from their code
(docs/serving.md): the arguments, the gate and beta handling, the state gathered from the pool (zeros for a
fresh sequence) and the layout it is kept in, the host-built chunk tables of SGLang's graph prefill.

It imports nothing of kda-conformance: the vendored backends (kernels/backends/vendored.py) call these with a
case's inputs, and a standalone repro file for a server's kernels (conformance/repro/standalone_finding.py)
carries this module verbatim, so the call its maintainer runs is the one the suite judged. ``kda`` is the
server's loaded kda module (kernels/server_stubs.py loads one from a source tree); every function returns
``(o, final states)``, the states in the layout the kernels keep (``v_first``: ``[N, H, V, K]``).
"""


import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import torch

# SGLang 0.5.23's CUDA-graph prefill (sglang/srt/layers/attention/linear/kda_prefill_graph.py) hands chunk_kda
# chunk tables it builds on the host before every replay.
GRAPH_CHUNK_METADATA = ("chunk_indices", "chunk_offsets")
GRAPH_PAD_CHUNK = 1 << 20  # a padded row's chunk: past the end of any sequence, so every kernel returns on it


def parameters(function: Callable) -> set[str]:
    return set(inspect.signature(function).parameters)


class LayerInputs(NamedTuple):
    """The tensors a layer hands its prefill call, as a case's inputs hold them (``[B, T, heads, ...]``; the
    initial states in the case's layout and dtype; cu_seqlens None for an unpacked batch)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    initial_state: torch.Tensor | None
    cu_seqlens: torch.Tensor | None


@dataclass(frozen=True)
class LayerOptions:
    """What a case sets of a layer's call: the states' layout in the case, the scale, q/k normalised in the
    kernel, beta's sigmoid in the kernel, the gate computed in the kernel, the lower bound of the lower-bound
    gate form (None for the others: passing it switches a fused gate to that form)."""

    state_v_first: bool
    scale: float | None
    l2norm: bool
    beta_sigmoid: bool
    gate_in_kernel: bool
    lower_bound: float | None


def layer_options(case: Any) -> LayerOptions:
    """A case's options (anything with the fields of kda-conformance's Case)."""
    bound = case.lower_bound if case.gate == "lower_bound" else None
    return LayerOptions(case.state_v_first, case.scale, case.l2norm_in_kernel, case.beta_sigmoid_in_kernel,
                        case.gate_in_kernel, bound)  # fmt: skip


def _states_for_call(x: LayerInputs, options: LayerOptions, v_first: bool) -> torch.Tensor:
    """Every sequence's fp32 state in the kernels' layout, as the layers gather them from the pool: zeros for
    fresh sequences (a fresh sequence's slot is zeroed before the gather)."""
    if x.initial_state is None:
        H, K, V = x.q.shape[-2], x.q.shape[-1], x.v.shape[-1]
        return torch.zeros((_sequences(x), H, V, K) if v_first else (_sequences(x), H, K, V), device=x.q.device)
    h0 = x.initial_state.float()
    return (h0 if options.state_v_first == v_first else h0.transpose(-1, -2)).contiguous()


def _sequences(x: LayerInputs) -> int:
    return x.q.shape[0] if x.cu_seqlens is None else x.cu_seqlens.numel() - 1


def _beta(beta: torch.Tensor, beta_sigmoid: bool) -> torch.Tensor:
    # Both servers apply the sigmoid before the call, in fp32 (``b_proj(x).float().sigmoid()``).
    return beta.float().sigmoid() if beta_sigmoid else beta.float()


def _gate_before_call(kda: ModuleType, x: LayerInputs) -> torch.Tensor:
    """The gate as the older trees' layers compute it before the call (``fused_kda_gate``), in g's shape."""
    return kda.fused_kda_gate(x.g, x.A_log.float(), x.g.shape[-1], g_bias=x.dt_bias.float()).view_as(x.g)


def _int32(cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
    # Both servers pass their int32 query_start_loc as cu_seqlens.
    return None if cu_seqlens is None else cu_seqlens.to(torch.int32)


def vllm_prefill(
    kda: ModuleType, x: LayerInputs, options: LayerOptions, v_first: bool, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's KDA layer (``KimiGatedDeltaNetAttention`` and its metadata builder): q, k, v packed
    ``[1, T, H, D]``, beta sigmoided in fp32 before the call, every sequence's state gathered from the fp32
    pool, the gate ``-exp(A_log) * softplus(g + dt_bias)`` (or the lower-bound form) inside
    ``chunk_kda_with_fused_gate`` where the tree has it, else ``fused_kda_gate`` before ``chunk_kda`` (older
    trees). ``out``: a slice of the layer's output buffer, handed where the fused entry takes ``out=`` (Kimi
    K3's layer) and returned as the output; otherwise the output is v's buffer, a copy of v here."""
    common = dict(
        scale=options.scale,
        initial_state=_states_for_call(x, options, v_first),
        output_final_state=True,
        use_qk_l2norm_in_kernel=options.l2norm,
        cu_seqlens=_int32(x.cu_seqlens),
    )
    v = x.v.clone()  # vLLM's kernels write the output into v's buffer
    fused = getattr(kda, "chunk_kda_with_fused_gate", None) if options.gate_in_kernel else None
    if fused is not None:
        takes = parameters(fused)
        extra: dict[str, object] = {}
        if "raw_beta" in takes:  # vLLM 0.33: beta's sigmoid (and the lower-bound gate) inside, A_log [H]
            extra["raw_beta"], A_log = x.beta, x.A_log.float()
        else:  # earlier: beta activated before the call, A_log as the layer's [1, 1, H, 1] parameter
            extra["beta"], A_log = _beta(x.beta, options.beta_sigmoid), x.A_log.float().view(1, 1, -1, 1)
        if options.lower_bound is not None:
            extra["lower_bound"] = options.lower_bound
        gate = dict(raw_g=x.g, A_log=A_log, g_bias=x.dt_bias.float())
        if out is None or "out" not in takes:
            return fused(q=x.q, k=x.k, v=v, **gate, **extra, **common)
        _, final = fused(q=x.q, k=x.k, v=v, **gate, **extra, **common, out=out)
        return out, final  # the layer reads its buffer, not what the call returns
    if options.gate_in_kernel:
        if not hasattr(kda, "fused_kda_gate"):
            raise NotImplementedError("this vLLM tree has neither chunk_kda_with_fused_gate nor fused_kda_gate")
        g = _gate_before_call(kda, x)
    else:
        g = x.g.float()
    return kda.chunk_kda(q=x.q, k=x.k, v=v, g=g, beta=_beta(x.beta, options.beta_sigmoid), **common)


def glm5_prefill(
    kda: ModuleType, x: LayerInputs, options: LayerOptions, v_first: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-5.3-Flash's layer as vLLM 0.33 serves it (glm5next/common/kda.py ``Glm5NextLinearAttention``):
    ``chunk_kda_with_fused_gate`` with the raw gate, beta sigmoided in fp32 before the call, ``A_log`` as the
    layer's ``[1, 1, H, 1]`` fp32 parameter, ``g_bias`` its fp32 ``dt_bias``, the safe gate always on with the
    model's lower bound, q/k normalised in the kernel (the layer's choices, whatever the options say), the
    states gathered from the pool; the output lands in v's buffer."""
    kwargs = {"scale": options.scale} if options.scale is not None else {}  # the layer leaves it at D ** -0.5
    return kda.chunk_kda_with_fused_gate(
        q=x.q,
        k=x.k,
        v=x.v.clone(),  # the kernel writes the output into v's buffer
        raw_g=x.g,
        beta=_beta(x.beta, options.beta_sigmoid),
        A_log=x.A_log.float().view(1, 1, -1, 1),
        g_bias=x.dt_bias.float(),
        initial_state=_states_for_call(x, options, v_first),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=_int32(x.cu_seqlens),
        safe_gate=True,
        lower_bound=options.lower_bound,
        **kwargs,
    )


def graph_chunk_tables(cu_seqlens_cpu: torch.Tensor, device: torch.device, chunk: int = 64) -> dict[str, torch.Tensor]:
    """``KDAPrefillGraphMetadata._write_host_tables`` for a bucket holding exactly this batch: (sequence,
    chunk) rows sequence by sequence, then ``cdiv(T, 64) + sequences`` rows in all, the rest padded with
    (0, 2^20); ``chunk_offsets`` each sequence's first row. One int32 buffer, copied to the device from
    pinned memory as SGLang copies it (no device-to-host sync), its two views returned."""
    lens = (cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1]).long()
    counts = (lens + chunk - 1) // chunk
    n, real = len(lens), int(counts.sum())
    rows = -(-int(cu_seqlens_cpu[-1]) // chunk) + n
    table = torch.tensor([0, GRAPH_PAD_CHUNK], dtype=torch.int64).repeat(rows, 1)
    table[:real, 0] = torch.repeat_interleave(torch.arange(n), counts)
    table[:real, 1] = torch.arange(real) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    host = torch.cat([table.flatten(), offsets]).to(torch.int32)
    packed = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    return {"chunk_indices": packed[: 2 * rows].view(rows, 2), "chunk_offsets": packed[2 * rows :]}


def sglang_takes_graph_tables(kda: ModuleType) -> bool:
    """Whether the tree's chunk_kda takes the graph prefill's chunk tables (SGLang captures the call then)."""
    return set(GRAPH_CHUNK_METADATA) <= parameters(kda.chunk_kda)


def sglang_prefill(
    kda: ModuleType,
    x: LayerInputs,
    options: LayerOptions,
    v_first: bool,
    host_metadata: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's layer (``TritonKDAKernel.extend``): the whole pool and ``initial_state_indices`` go to
    ``chunk_kda``, which reads each sequence's slot and writes its final state there in place (slots zeroed
    when allocated: a fresh sequence's holds zeros); ``A_log``/``dt_bias``/``lower_bound`` go in where the
    signature takes them (the gate inside the kernel), else the gate is given activated; the raw beta with
    ``beta_is_raw`` where it takes that. ``host_metadata``: the graph prefill's chunk tables."""
    takes = parameters(kda.chunk_kda)
    gate: dict[str, object] = {}
    g = x.g
    if options.gate_in_kernel and "A_log" in takes:
        gate = {"A_log": x.A_log.float().view(1, 1, -1, 1), "dt_bias": x.dt_bias.float()}
        if options.lower_bound is not None:
            gate["lower_bound"] = options.lower_bound
    elif options.gate_in_kernel:
        g = _gate_before_call(kda, x)
    v = x.v.clone()  # SGLang's kernels write the output into v's buffer
    common = dict(scale=options.scale, use_qk_l2norm_in_kernel=options.l2norm, cu_seqlens=_int32(x.cu_seqlens), **gate)
    common.update(host_metadata or {})
    if options.beta_sigmoid and "beta_is_raw" in takes:
        # SGLang's KDA backend passes the raw projection and beta_is_raw=True where chunk_kda takes it
        beta, common["beta_is_raw"] = x.beta, True
    else:
        beta = _beta(x.beta, options.beta_sigmoid)
    if "initial_state_indices" in takes:
        # The pool: slot 0 the null block, sequence n in slot n + 1, zeroed at allocation, written in place.
        states = _states_for_call(x, options, v_first)
        pool = torch.cat([torch.zeros_like(states[:1]), states])
        slots = torch.arange(1, _sequences(x) + 1, dtype=torch.int32, device=x.q.device)
        o = kda.chunk_kda(q=x.q, k=x.k, v=v, g=g, beta=beta, initial_state=pool, initial_state_indices=slots, **common)
        return o, pool[1:]
    h0 = None if x.initial_state is None else _states_for_call(x, options, v_first)
    return kda.chunk_kda(q=x.q, k=x.k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True, **common)


class UnknownLayout(Exception):
    """The probe's final state says neither layout (any error of the kernels' own propagates as it is)."""


def probe_v_first(prefill: Callable, kda: ModuleType, device: torch.device, options: LayerOptions) -> bool:
    """Whether the kernels keep the state V-first: one call of ``prefill`` with K = 16, V = 32 on zero tokens
    (valid for every gate form) and fresh states; its final state's shape says (a kernel that checks its
    initial state's shape is given the other layout if the first is refused)."""
    q = torch.zeros((1, 3, 1, 16), dtype=torch.bfloat16, device=device)
    v, beta = q.new_zeros((1, 3, 1, 32)), q.new_zeros((1, 3, 1))
    x = LayerInputs(q, q.clone(), v, q.clone(), beta, torch.zeros(1, device=device), torch.zeros(16, device=device),
                    None, None)  # fmt: skip
    with torch.inference_mode():
        try:
            _, final = prefill(kda, x, options, True)
        except Exception:
            _, final = prefill(kda, x, options, False)
    if tuple(final.shape[-2:]) not in ((32, 16), (16, 32)):
        raise UnknownLayout(f"the kernels' final state has shape {tuple(final.shape)} for K=16, V=32")
    return tuple(final.shape[-2:]) == (32, 16)



TREE = ('KDA_VLLM_SRC', 'vllm', ('vllm.models.kimi_k3.nvidia.ops.third_party.kda', 'vllm.third_party.flash_linear_attention.ops.kda', 'vllm.model_executor.layers.fla.ops.kda'), ('vllm.third_party.flash_linear_attention.ops',))  # (the variable naming a source tree, the top package, where kda.py lives newest first, bare packages)


def kda_module():
    # vLLM's KDA kernels: from the source tree KDA_VLLM_SRC names, loaded as kda-conformance loads it (its
    # packages bare, the server modules its kernels import stubbed: import_kda above), else the installed vLLM's.
    variable, package, modules, bare = TREE
    root = os.environ.get(variable)
    if root:
        return import_kda(Path(root), package, modules, bare)
    for module in modules:
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == package:
                break
            if not (exc.name and module.startswith(exc.name)):  # not another layout's folder: something it imports
                return needs(module)
    pytest.skip("needs vLLM with its KDA kernels (pip install vllm), or its source tree named by KDA_VLLM_SRC")


def call(q, k, v, g, beta, initial_state, cu_seqlens, **kwargs):
    kda = kda_module()
    options = layer_options(CASE)  # the case's options, as the layer hands them
    with torch.inference_mode():
        v_first = probe_v_first(vllm_prefill, kda, q.device, options)  # the layout the kernels keep states in
        x = LayerInputs(q, k, v, g, beta, kwargs["A_log"], kwargs["dt_bias"], initial_state, cu_seqlens)
        o, final = vllm_prefill(kda, x, options, v_first, out=torch.full_like(v, float("nan")))
    return o, final if v_first == CASE.state_v_first else final.transpose(-1, -2)



def where_it_runs():
    if not torch.cuda.is_available():
        pytest.skip('needs a GPU (the finding was measured on cuda NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, vLLM vllm 0.33.0 (KDA_VLLM_SRC)); torch sees none')
    return "cuda"


# Limits: limit = min(cap, max(factor x baseline, floor)), the baseline the same case through a plain PyTorch
# chunked KDA at working precision; see kda-conformance docs/tolerance.md.
# o: max-abs limit 0.001507 (set by the baseline: baseline 0.000377 x 4, floor 0.000245, cap 0.00391); rel-RMS limit 0.007542 (set by the baseline: baseline 0.00377 x 2)
# final_state: max-abs limit 0.01637 (set by the baseline: baseline 0.00409 x 4, floor 0.000847, cap 0.0537); rel-RMS limit 0.005106 (set by the baseline: baseline 0.00255 x 2)
LIMITS = {'o': {'max_abs': 0.0015072536277203064, 'rel_rms': 0.0075421570436770115}, 'final_state': {'max_abs': 0.016371748550654708, 'rel_rms': 0.005106305405157687}}
LIBRARY_TOLERANCE = {'o': 0.005}  # rel-RMS, from the library's own tests
MEASURED = {'o': {'max_abs': 0.0625281034777499, 'rel_rms': 0.9248621744246595, 'nonfinite': 0}, 'final_state': {'max_abs': 0.00409108939367564, 'rel_rms': 0.002546303781428136, 'nonfinite': 0}}  # when written, on cuda NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, vLLM vllm 0.33.0 (KDA_VLLM_SRC)
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
    rel_rms = math.inf if nonfinite else (float(err.pow(2).mean().sqrt()) / ref if err.numel() else 0.0)
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
FILLER = 1048176  # tokens of zeros the case's sequences are packed behind


def test_servers_chunk_states_offset_int32():
    device = where_it_runs()
    x = draw(CASE)  # the suite's inputs, bit for bit, on the CPU
    kwargs = dict(
        scale=None,
        use_qk_l2norm_in_kernel=False,
        use_beta_sigmoid_in_kernel=True,
        use_gate_in_kernel=True,
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=-1.0,
        state_v_first=True,
    )
    o_true, final_true = kda_token_loop(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"],
        **kwargs,
    )
    moved = {name: None if t is None else t.to(device) for name, t in x.items()}
    # The case's sequences packed behind FILLER tokens of zeros, so that they start past 2^31 elements of the
    # token tensors (or of the per-chunk states a chunk kernel keeps); the case's rows are judged where they land.
    tokens = {n: moved[n] for n in TOKENS}
    tokens, moved["initial_state"], moved["cu_seqlens"] = behind_filler(
        tokens, moved["initial_state"], moved["cu_seqlens"], FILLER
    )
    q, k, v, g, beta = (tokens[n] for n in TOKENS)
    kwargs.update(A_log=moved["A_log"], dt_bias=moved["dt_bias"])
    h0 = None if moved["initial_state"] is None else moved["initial_state"].float()  # a pool's state, widened
    with contextlib.nullcontext():
        o, final = call(q, k, v, g, beta, h0, moved["cu_seqlens"], **kwargs)
    o, final = o[:, FILLER:], None if final is None else final[1:]  # the case's rows, its sequences' states
    problems, lines = [], []
    held("o", o, o_true, problems, lines)
    held("final_state", final, final_true, problems, lines)
    print("\n".join(lines))
    assert not problems, "\n".join(problems + lines)
