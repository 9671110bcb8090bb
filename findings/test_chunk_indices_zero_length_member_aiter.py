"""chunk-indices-zero-length-member: AITER e4048607a535ace3a2b51ded31b1c8c2d45c0879 (KDA_AITER_SRC), T150+0+97 bf16 H4/4 K128V128 lb-5 h0:random.

What goes wrong: a zero-length sequence in cu_seqlens breaks the sequences after it: prepare_chunk_indices
numbers sequences by the chunks that start at 0 (indices.eq(0).cumsum(0) - 1), so an empty member shifts every
later chunk onto the wrong sequence. On an H200, T150+0+97 (bf16, 4 heads, K = V = 128, h0): vLLM's and
SGLang's copies 1690 times the max-abs limit (o), final states 411 times or non-finite, differing from run to
run; AITER's FlashKDA 49664 non-finite outputs, its default pipeline max-abs 0.144 (68 % rel-RMS); in the CPU
interpreter T0+1 3857 times (vLLM). A trailing empty member is harmless. FLA fixed the numbering in PR #909
(commit 16405f24, fla-core 0.5.1); the three copies predate the fix. Whether vLLM's scheduler ever passes an
empty member mid-batch is not established; SGLang's server puts empty (padding) members last

Measured with kda-conformance (backend aiter_flashkda, check budget) on cuda NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, AITER e4048607a535ace3a2b51ded31b1c8c2d45c0879 (KDA_AITER_SRC): o max-abs inf, rel-RMS inf; final_state max-abs inf, rel-RMS inf. The limits below are the suite's (docs/tolerance.md in kda-conformance); the library's own tests allow rel-RMS 0.02 (ROCm/aiter op_tests/triton_tests test_flash_kda.py: rel_err = ||a - b|| / ||b|| < 2e-2 against a float32 token recurrence and against the default pipeline).

Upstream:
- pr fla-org/flash-linear-attention#909: merged: commit 16405f24 ('Make varlen index helpers torch.compile-friendly'), in fla-core 0.5.1 and later, counts empty segments right; not in the AITER, vLLM and SGLang copies (https://github.com/fla-org/flash-linear-attention/pull/909)

Run: pytest test_chunk_indices_zero_length_member_aiter.py (needs torch, pytest and AITER; KDA_AITER_SRC=DIR loads it from a source tree). It fails while the kernel is wrong, passes once it is right, and skips naming what is missing.
Case (kda-conformance --case): {"beta_regime": "typical", "beta_sigmoid_in_kernel": true, "checkpoints": [], "dtype": "bf16", "gate": "lower_bound", "gate_dtype": "same", "gate_regime": "typical", "head_k_dim": 128, "head_v_dim": 128, "initial_state": "random", "input_layout": "contiguous", "input_scale": "typical", "key_regime": "random", "key_rho": 0.0, "l2norm_in_kernel": true, "lower_bound": -5.0, "num_heads": 4, "num_v_heads": 4, "packed": true, "pool_layout": "dense", "safe_gate": true, "scale": null, "seed": 150097, "seq_lens": [150, 0, 97], "state_dtype": "fp32", "state_layout": "k_first", "tags": [], "zero_tokens": "none"}
"""

import contextlib
import importlib
import itertools
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

CASE = SimpleNamespace(
    seq_lens=[150, 0, 97],
    packed=True,
    num_heads=4,
    num_v_heads=4,
    head_k_dim=128,
    head_v_dim=128,
    dtype='bf16',
    state_dtype='fp32',
    gate='lower_bound',
    lower_bound=-5.0,
    safe_gate=True,
    gate_regime='typical',
    key_regime='random',
    key_rho=0.0,
    beta_regime='typical',
    l2norm_in_kernel=True,
    beta_sigmoid_in_kernel=True,
    initial_state='random',
    state_layout='k_first',
    input_layout='contiguous',
    input_scale='typical',
    pool_layout='dense',
    gate_dtype='same',
    zero_tokens='none',
    checkpoints=[],
    scale=None,
    seed=150097,
    row_spans=((0, 0, 150), (0, 150, 150), (0, 150, 247)),
    offsets=(0, 150, 150, 247),
    total_tokens=247,
    num_seqs=3,
    gate_in_kernel=True,
    has_initial_state=True,
    state_v_first=False,
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

LIBRARIES = {'aiter': ('AITER', 'ROCm/aiter, installed or as a source tree named by KDA_AITER_SRC', 'KDA_AITER_SRC')}


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
    import types

    os.environ.setdefault("AITER_TRITON_ONLY", "1")
    tree = os.environ.get("KDA_AITER_SRC")
    if tree and "aiter" not in sys.modules:
        # AITER's Triton source without its HIP build: aiter and aiter.ops as bare packages, their __init__
        # (a JIT build of the HIP kernels) never run.
        for name, folder in (("aiter", ("aiter",)), ("aiter.ops", ("aiter", "ops"))):
            package = types.ModuleType(name)
            package.__path__ = [os.path.join(tree, *folder)]
            sys.modules[name] = package
    entry = needs("aiter.ops.triton.kimi_delta_attn").chunk_kimi_delta_attn
    # The path: FlashKDA on, through the module constants AITER reads from the environment at import.
    for module in [m for n, m in list(sys.modules.items()) if n.startswith("aiter.") and m is not None]:
        for switch in ('AITER_FDA_ENABLE', 'CHUNK_DELTA_ATTN_USE_FLASH_KDA'):
            if hasattr(module, switch):
                setattr(module, switch, True)
    os.environ.pop('CHUNK_DELTA_ATTN_FLASH_KDA_SEG', None)  # AITER's default segment length
    for module in [m for n, m in list(sys.modules.items()) if n.startswith("aiter.") and m is not None]:
        if callable(getattr(module, "flash_kda_supported", None)):
            checked = {name: kwargs.get(name) for name in ('use_gate_in_kernel', 'use_qk_l2norm_in_kernel', 'use_beta_sigmoid_in_kernel', 'lower_bound', 'A_log')}
            admitted = module.flash_kda_supported(q=q, v=v, chunk_size=32, safe_gate=True, **checked)
            print(f"AITER's flash_kda_supported says {admitted}: the FlashKDA path", "runs" if admitted else
                  "is refused, and AITER would run its default pipeline")
            assert admitted, "AITER refuses the FlashKDA path on this call: the file would test another one"
            break
    h0 = None if initial_state is None else initial_state.float()
    return entry(
        q, k, v, g, beta, initial_state=h0, cu_seqlens=cu_seqlens, output_final_state=True,
        safe_gate=True, chunk_size=None, **kwargs
    )



def where_it_runs():
    if not torch.cuda.is_available():
        pytest.skip('needs a GPU (the finding was measured on cuda NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, AITER e4048607a535ace3a2b51ded31b1c8c2d45c0879 (KDA_AITER_SRC)); torch sees none')
    return "cuda"


# ---- kda-conformance kernels/serving.py, verbatim ----------------------------------------
SENTINEL = 1e+30


@contextmanager
def poisoned_scratch(device: torch.device, poison: str) -> Iterator[None]:
    """Make memory a backend allocates and does not write visible: ``torch.empty`` returns NaN (PyTorch's
    fill-uninitialized-memory mode) and, on CUDA, the caching allocator hands out blocks pre-filled with
    ``poison``."""
    if poison == "none":
        yield
        return
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        if device.type == "cuda":
            _prefill_allocator(device, poison)
        yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic, warn_only=was_warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = was_filling


def _prefill_allocator(device: torch.device, poison: str) -> None:
    """Fill blocks of the caching allocator's small and large pools with ``poison`` and free them, so the
    next allocations reuse poisoned memory instead of fresh (often zeroed) device memory."""
    value = {"nan": float("nan"), "inf": float("inf"), "sentinel": SENTINEL}.get(poison, 1e30)
    blocks = [torch.empty(n, dtype=torch.float32, device=device) for n in [2**17] * 8 + [2**24] * 4 + [2**27]]
    for block in blocks:
        block.fill_(value)
    del blocks


# Limits: limit = min(cap, max(factor x baseline, floor)), the baseline the same case through a plain PyTorch
# chunked KDA at working precision; see kda-conformance docs/tolerance.md.
# o: max-abs limit 0.003177 (set by the baseline: baseline 0.000794 x 4, floor 0.000644, cap 0.0103); rel-RMS limit 0.006656 (set by the baseline: baseline 0.00333 x 2)
# final_state: max-abs limit 0.01533 (set by the baseline: baseline 0.00383 x 4, floor 0.00417, cap 0.265); rel-RMS limit 0.0009815 (set by the floor: baseline 0.000219 x 2)
LIMITS = {'o': {'max_abs': 0.003177281264303833, 'rel_rms': 0.00665637084161579}, 'final_state': {'max_abs': 0.015327187564723843, 'rel_rms': 0.0009815315401555697}}
LIBRARY_TOLERANCE = {'o': 0.02}  # rel-RMS, from the library's own tests
MEASURED = {'o': {'max_abs': float('inf'), 'rel_rms': float('inf'), 'nonfinite': 49664}, 'final_state': {'max_abs': float('inf'), 'rel_rms': float('inf'), 'nonfinite': 65536}}  # when written, on cuda NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, AITER e4048607a535ace3a2b51ded31b1c8c2d45c0879 (KDA_AITER_SRC)
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


def test_chunk_indices_zero_length_member():
    device = where_it_runs()
    x = draw(CASE)  # the suite's inputs, bit for bit, on the CPU
    kwargs = dict(
        scale=None,
        use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        use_gate_in_kernel=True,
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=-5.0,
        state_v_first=False,
    )
    o_true, final_true = kda_token_loop(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"],
        **kwargs,
    )
    moved = {name: None if t is None else t.to(device) for name, t in x.items()}
    q, k, v, g, beta = laid_out(CASE.input_layout, *(moved[n] for n in TOKENS))
    kwargs.update(A_log=moved["A_log"], dt_bias=moved["dt_bias"])
    h0 = None if moved["initial_state"] is None else moved["initial_state"].float()  # a pool's state, widened
    with poisoned_scratch(torch.device(device), "nan"):
        o, final = call(q, k, v, g, beta, h0, moved["cu_seqlens"], **kwargs)
    problems, lines = [], []
    held("o", o, o_true, problems, lines)
    held("final_state", final, final_true, problems, lines)
    print("\n".join(lines))
    assert not problems, "\n".join(problems + lines)
