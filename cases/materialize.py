"""Seeded inputs for a Case: drawn on the CPU from the seed, then moved, so one id means one set of bits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

from kda_cases.case import Case
from kda_cases.dtypes import TORCH_DTYPES


@dataclass(frozen=True)
class KDAOptions:
    """Everything a KDA call takes besides ``q k v g beta``, in chunk_kda's terms, as one typed object.

    The reference's forms take it whole; :meth:`kernel_kwargs` spells it as chunk_kda's keywords.
    ``checkpoints`` lists ``(sequence, tokens)`` pairs: the state of that sequence after its first
    ``tokens`` tokens (a reference output; kernels have no such argument).
    """

    scale: float | None = None
    initial_state: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | Sequence[int] | None = None
    use_qk_l2norm_in_kernel: bool = False
    use_beta_sigmoid_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    A_log: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    lower_bound: float | None = None
    state_v_first: bool = False
    checkpoints: Sequence[tuple[int, int]] = ()

    def kernel_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of chunk_kda-style kernels (FLA's, AITER's): every field but the
        checkpoints, which are the reference's alone."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "checkpoints"}


@dataclass(frozen=True)
class KDAInputs:
    """Everything a backend call needs, in the form chunk_kda takes it.

    ``q k v g beta`` are in the case's input dtype; ``g`` and ``beta`` are raw
    pre-activations when the case applies the gate or sigmoid in the kernel.
    ``initial_state`` is in the case's state dtype and layout.
    """

    case: Case
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    initial_state: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    # Sequence metadata built on the host and passed in, as servers do (``Backend.host_metadata``); None:
    # the kernel derives what it needs from ``cu_seqlens`` itself.
    host_metadata: Mapping[str, torch.Tensor] | None = None

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def options(self) -> KDAOptions:
        """The call's options as the case defines them (the case's checkpoints included)."""
        c = self.case
        return KDAOptions(
            scale=c.scale,
            initial_state=self.initial_state,
            cu_seqlens=self.cu_seqlens,
            use_qk_l2norm_in_kernel=c.l2norm_in_kernel,
            use_beta_sigmoid_in_kernel=c.beta_sigmoid_in_kernel,
            use_gate_in_kernel=c.gate_in_kernel,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            lower_bound=c.lower_bound,
            state_v_first=c.state_v_first,
            checkpoints=c.checkpoints,
        )

    def kernel_kwargs(self) -> dict[str, Any]:
        """chunk_kda's keyword arguments for these inputs."""
        return self.options.kernel_kwargs()


def _keys(case: Case, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    k = torch.randn(shape, generator=gen)
    if case.key_regime == "correlated":
        # AR(1) along time per sequence: k_t = rho k_{t-1} + sqrt(1 - rho^2) noise.
        rho = case.key_rho
        out = torch.empty_like(k)
        for _, start, end in case.row_spans:
            prev = None
            for t in range(start, end):
                prev = k[:, t] if prev is None else rho * prev + (1 - rho * rho) ** 0.5 * k[:, t]
                out[:, t] = prev
        k = out
    elif case.key_regime == "repeated":
        # Runs of 16 identical tokens, the pattern that broke FlashKDA's fp16 inverse.
        index = torch.arange(shape[1]) // 16 * 16
        k = k[:, index]
    if not case.l2norm_in_kernel:
        # The delta rule is stable for unit-norm keys; normalize here when the kernel does not.
        k = F.normalize(k, dim=-1)
    return k


def _gate(
    case: Case, shape: tuple[int, ...], gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    HV, K = case.num_v_heads, case.head_k_dim
    noise = torch.randn(shape, generator=gen)
    A_log = dt_bias = None
    if not case.gate_in_kernel:  # a precomputed gate (GATES in cases/case.py)
        if case.gate_regime == "weak":
            g = -torch.rand(shape, generator=gen) * 0.01
        elif case.gate_regime == "strong":
            g = -3.0 - 2.0 * torch.rand(shape, generator=gen)
        else:
            g = F.logsigmoid(noise)
            if case.gate_regime == "reset":
                g = torch.where(_reset_tokens(shape, gen), torch.full_like(g, -30.0), g)
        if case.lower_bound is not None:
            # A precomputed gate under safe_gate must respect the bound itself.
            g = g.clamp(min=case.lower_bound)
        return g, None, None
    A_log = torch.log(torch.empty(HV).uniform_(1.0, 16.0, generator=gen))
    dt_bias = 0.1 * torch.randn(HV * K, generator=gen)
    # Raw pre-activations: a negative shift makes softplus / sigmoid tiny (decay near 1,
    # weak), a positive one saturates them (strong decay, at the lower bound if any).
    shift = {"typical": 0.0, "weak": -8.0, "strong": 4.0, "reset": 0.0}[case.gate_regime]
    raw = noise + shift
    if case.gate_regime == "reset":
        # Saturate the activation: the strongest decay the gate form allows (lower_bound, or exp(-huge)).
        raw = torch.where(_reset_tokens(shape, gen), torch.full_like(raw, 30.0), raw)
    return raw, A_log, dt_bias


def _reset_tokens(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Hard resets: about one token in 32 (all heads and keys of it) forgets almost everything."""
    B, T = shape[0], shape[1]
    hits = torch.rand(B, T, generator=gen) < 1.0 / 32
    return hits.view(B, T, *([1] * (len(shape) - 2))).expand(shape)


def _scaled(
    case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The case's magnitude regime (``INPUT_SCALES``): v, and q and k where the kernel normalizes them (the
    suite's unit keys keep the delta rule stable otherwise, and unit queries keep |o| about max |v|:
    representable in fp16), scaled x10 to x100 (``large``), or a few of their tokens and channels x100 to
    x1000 (``outliers``). Queries scaled beside values multiply into the output: on the H200 the fp16
    baseline of T8191+8191 (K = V = 256, weak gates, outliers, no in-kernel l2norm) was not finite."""
    if case.input_scale == "typical":
        return q, k, v
    scaled = [v, q, k] if case.l2norm_in_kernel else [v]
    out = []
    for x in scaled:
        if case.input_scale == "large":
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
    if not case.l2norm_in_kernel:
        return q, k, out[0]
    return out[1], out[2], out[0]


def materialize(case: Case, device: str | torch.device = "cpu", drawn: KDAInputs | None = None) -> KDAInputs:
    """Draw the case's tensors on the CPU from its seed and move them to ``device`` in the case's layout
    (``drawn``: the case's ``drawn_on_cpu`` tensors, drawn ahead)."""
    if drawn is None:
        drawn = drawn_on_cpu(case)
    elif drawn.case != case:
        raise ValueError(f"drawn: tensors of case {drawn.case.id}, not of {case.id}")
    dev = torch.device(device)

    def move(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(dev)

    # Moved first, laid out after: a view of a fused buffer moved alone would arrive contiguous.
    tokens = laid_out(case.input_layout, *(move(getattr(drawn, name)) for name in ("q", "k", "v", "g", "beta")))
    return KDAInputs(
        case=case,
        **dict(zip(("q", "k", "v", "g", "beta"), tokens, strict=True)),
        A_log=move(drawn.A_log),
        dt_bias=move(drawn.dt_bias),
        initial_state=move(drawn.initial_state),
        cu_seqlens=move(drawn.cu_seqlens),
    )


def drawn_on_cpu(case: Case) -> KDAInputs:
    """The case's tensors drawn on the CPU from its seed, in their dtypes and contiguous: the CPU work of
    ``materialize`` (seconds for a large case on one thread), which needs no device memory, so a run can do
    it before it takes its share of a GPU."""
    gen = torch.Generator(device="cpu").manual_seed(case.seed)
    B = 1 if case.packed else case.num_seqs
    T = case.total_tokens if case.packed else case.seq_lens[0]
    H, HV, K, V = case.num_heads, case.num_v_heads, case.head_k_dim, case.head_v_dim
    q = torch.randn(B, T, H, K, generator=gen)
    k = _keys(case, (B, T, H, K), gen)
    if not case.l2norm_in_kernel:
        q = F.normalize(q, dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g, A_log, dt_bias = _gate(case, (B, T, HV, K), gen)
    beta_raw = torch.randn(B, T, HV, generator=gen) + (6.0 if case.beta_regime == "near_one" else 0.0)
    beta = beta_raw if case.beta_sigmoid_in_kernel else torch.sigmoid(beta_raw)

    h0 = None
    if case.has_initial_state:
        h0 = torch.randn(case.num_seqs, HV, K, V, generator=gen)
        if case.initial_state == "large":
            h0 = h0 * 30.0
        if case.state_v_first:
            h0 = h0.transpose(-1, -2).contiguous()
        h0 = h0.to(TORCH_DTYPES[case.state_dtype])

    q, k, v = _scaled(case, q, k, v, gen)  # drawn last: a typical case's bits are what they were
    cu = cu_seqlens_tensor(case, "cpu", dtype=torch.long) if case.packed else None

    dtype = TORCH_DTYPES[case.dtype]
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    return KDAInputs(case=case, q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0,
                     cu_seqlens=cu)  # fmt: skip


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


def cu_seqlens_tensor(
    case: Case, device: str | torch.device, padding: int = 0, dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    """``case.cu_seqlens(padding)`` as a tensor on ``device`` (int32, as servers pass it, unless asked)."""
    return torch.tensor(case.cu_seqlens(padding), dtype=dtype, device=device)
