"""fla-kernels-fp16-strong-gates: AITER e4048607a5 (KDA_AITER_SRC); fla-core 0.6.0, T2049 fp16 H8/8 K256V256 lb-0.01 reset correlated1 S:bf16 fused pool:padded scale0.125.

What goes wrong: FLA's chunk kernels (and AITER's port of them) with fp16 inputs and the strongest decays
(strong gates, or gates saturated at their lower bound): outputs past the limits of their own declared design,
TF32 dots. On an H100 (2026-12-05), against the baseline at that design (TF32 operands cut, as Triton's dots
take them), the guaranteed case T2049 fp16 H8/8 K256V256 lb-0.01 reset (keys correlated at rho 1): FLA's
output rel-RMS 7.35e-3 against a limit of 7.03e-3 (1.05x; 1.47 times FLA's own test tolerance of 5e-3),
AITER's 7.29e-3 (1.04x; 0.36 of AITER's 2e-2); 8 of 8 fresh draws of the case fail both, at 1.01x to 1.04x.
Earlier, against the strict baseline on an H200: rel-RMS 1.09 (FLA) and 1.35 (AITER, split and two-step
prefills of 6852 and 13704 tokens) times the strict limits

Measured with kda-conformance (backend fla_chunk, check budget) on cuda NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, fla-core 0.6.0: o max-abs 0.00137, rel-RMS 0.00735; final_state max-abs 0.00269, rel-RMS 0.00299. The limits below are the suite's (docs/tolerance.md in kda-conformance), at the kernel's declared working precision (tf32-truncated dots); the library's own tests allow rel-RMS 0.005 (fla-org/flash-linear-attention tests/ops/test_kda.py test_chunk: assert_close('o', ...) and assert_close('ht', ...) at 0.005 against naive_recurrent_kda (float32); fla/utils/_testing.py get_err_ratio: RMS of the difference over RMS of the reference (with FLA_CI_ENV=1 a miss below 0.01, or with max-abs <= 0.3, only warns)).

Upstream:
- not reported: 1.05 times the limits of FLA's declared TF32 design and 1.47 times FLA's own test tolerance on one guaranteed case (H100, 2026-12-05); findings/test_fla_kernels_fp16_strong_gates_fla.py is the standalone repro

Run: pytest test_fla_kernels_fp16_strong_gates_fla.py (needs torch, pytest and fla-core). It fails while the kernel is wrong, passes once it is right, and skips naming what is missing.
Case (kda-conformance --case): {"beta_regime": "near_one", "beta_sigmoid_in_kernel": true, "checkpoints": [[0, 926]], "dtype": "fp16", "gate": "lower_bound", "gate_dtype": "same", "gate_regime": "reset", "head_k_dim": 256, "head_v_dim": 256, "initial_state": "none", "input_layout": "fused", "input_scale": "typical", "key_regime": "correlated", "key_rho": 1.0, "l2norm_in_kernel": false, "lower_bound": -0.01, "num_heads": 8, "num_v_heads": 8, "packed": false, "pool_layout": "padded", "safe_gate": true, "scale": 0.125, "seed": 1464690218, "seq_lens": [2049], "state_dtype": "bf16", "state_layout": "k_first", "tags": ["guaranteed"], "zero_tokens": "none"}
"""

import importlib
import itertools
import math
import os
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

CASE = SimpleNamespace(
    seq_lens=[2049],
    packed=False,
    num_heads=8,
    num_v_heads=8,
    head_k_dim=256,
    head_v_dim=256,
    dtype='fp16',
    state_dtype='bf16',
    gate='lower_bound',
    lower_bound=-0.01,
    safe_gate=True,
    gate_regime='reset',
    key_regime='correlated',
    key_rho=1.0,
    beta_regime='near_one',
    l2norm_in_kernel=False,
    beta_sigmoid_in_kernel=True,
    initial_state='none',
    state_layout='k_first',
    input_layout='fused',
    input_scale='typical',
    pool_layout='padded',
    gate_dtype='same',
    zero_tokens='none',
    checkpoints=[[0, 926]],
    scale=0.125,
    seed=1464690218,
    row_spans=((0, 0, 2049),),
    offsets=(0, 2049),
    total_tokens=2049,
    num_seqs=1,
    gate_in_kernel=True,
    has_initial_state=False,
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


def draw(spec: Any) -> dict[str, torch.Tensor | None]:
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


def _zero_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gen: torch.Generator) -> tuple:
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


def _scaled(spec: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gen: torch.Generator) -> tuple:
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
        q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, output_final_state=True, safe_gate=True, chunk_size=64, **kwargs
    )



def where_it_runs():
    if not torch.cuda.is_available():
        pytest.skip('needs a GPU (the finding was measured on cuda NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, fla-core 0.6.0); torch sees none')
    return "cuda"


# Limits: limit = min(cap, max(factor x baseline, floor)), the baseline the same case through a plain PyTorch
# chunked KDA at working precision; see kda-conformance docs/tolerance.md.
# o: max-abs limit 0.00141 (set by the baseline: baseline 0.000353 x 4, floor 5.9e-05, cap 0.00362); rel-RMS limit 0.00703 (set by the baseline: baseline 0.00351 x 2)
# final_state: max-abs limit 0.01003 (set by the baseline: baseline 0.00251 x 4, floor 0.00304, cap 0.0484); rel-RMS limit 0.005948 (set by the baseline: baseline 0.00297 x 2)
LIMITS = {'o': {'max_abs': 0.0014103951553246646, 'rel_rms': 0.007029778781639183}, 'final_state': {'max_abs': 0.01002846577231642, 'rel_rms': 0.005947939022754234}}
LIBRARY_TOLERANCE = {'o': 0.005, 'final_state': 0.005}  # rel-RMS, from the library's own tests
MEASURED = {'o': {'max_abs': 0.0013680665227128047, 'rel_rms': 0.007351726894069681, 'nonfinite': 0}, 'final_state': {'max_abs': 0.0026934304107165685, 'rel_rms': 0.002990034811976605, 'nonfinite': 0}}  # when written, on cuda NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, fla-core 0.6.0
TINY = torch.finfo(torch.float64).tiny


def errors(got, want):
    err = (got.double().cpu() - want).abs()
    finite = bool(err.isfinite().all())
    rms = float(err.pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp_min(TINY)) if finite else math.inf
    return err, (float(err.max()) if finite else math.inf), rms, int((~got.isfinite()).sum())


def test_fla_kernels_fp16_strong_gates():
    device = where_it_runs()
    x = draw(CASE)  # the suite's inputs, bit for bit, on the CPU
    kwargs = dict(
        scale=0.125,
        use_qk_l2norm_in_kernel=False,
        use_beta_sigmoid_in_kernel=True,
        use_gate_in_kernel=True,
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=-0.01,
        state_v_first=False,
    )
    o_true, final_true = kda_token_loop(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"],
        **kwargs,
    )
    moved = {name: None if t is None else t.to(device) for name, t in x.items()}
    q, k, v, g, beta = laid_out(CASE.input_layout, *(moved[n] for n in ("q", "k", "v", "g", "beta")))
    kwargs.update(A_log=moved["A_log"], dt_bias=moved["dt_bias"])
    h0 = None if moved["initial_state"] is None else moved["initial_state"].float()  # a pool's state, widened
    o, final = call(q, k, v, g, beta, h0, moved["cu_seqlens"], **kwargs)
    problems, lines = [], []
    for name, got, want in (("o", o, o_true), ("final_state", final, final_true)):
        if got is None or tuple(got.shape) != tuple(want.shape):
            shape = None if got is None else list(got.shape)
            problems.append(f"{name}: shape {shape} != {list(want.shape)}")
            continue
        err, max_abs, rel_rms, nonfinite = errors(got, want)
        if name not in LIMITS:  # a crash's finding: the call runs, and its result is whole and finite
            problems += [f"{name}: {nonfinite} non-finite values"] if nonfinite else []
            lines.append(f"{name}: max-abs {max_abs:.3e}, rel-RMS {rel_rms:.3e} (no limits recorded)")
            continue
        limit = LIMITS[name]
        then = MEASURED[name]
        line = f"{name}: max-abs {max_abs:.3e} (limit {limit['max_abs']:.3e}), rel-RMS {rel_rms:.3e}"
        line += f" (limit {limit['rel_rms']:.3e}); when written {then['max_abs']:.3e},"
        line += f" {then['rel_rms']:.3e}"
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
                    bad = (err > limit["max_abs"]) | ~err.isfinite()
                    problem += f", first at (row, token, head) {tuple(bad.nonzero()[0].tolist()[:3])}"
                problems.append(problem)
    print("\n".join(lines))
    assert not problems, "\n".join(problems + lines)
