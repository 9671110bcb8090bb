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
