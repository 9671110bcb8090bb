"""Gradients of KDA in float64: the ground truth for a kernel's backward pass.

For upstream gradients ``d_o`` (of the outputs) and ``d_final`` (of the final states), the gradient of
``sum(o * d_o) + sum(final_state * d_final)`` with respect to every input a call takes: q, k, v, g, beta, the
initial state, and ``A_log`` and ``dt_bias`` where the gate is computed in the kernel. The preprocessing (scale,
q/k l2norm, beta's sigmoid, the gate) is differentiated with the recurrence, as a kernel's backward must.

Autograd computes them through one of two float64 forms of the recurrence, each a differentiable rewrite of a
forward form (tests hold the two within 1e-10 of each other, and each to finite differences):

- ``loop``: the definition, token by token (``reference/plain.py``'s recurrence), for short cases;
- ``chunked``: the chunked matmul algebra of ``reference/chunked.py``, written without in-place updates so that
  autograd can go through it (the forward form updates its state buffers in place, which autograd refuses).

Memory stays bounded at any length: each sequence is cut into segments of ``segment_tokens`` tokens, and each
segment is checkpointed (``torch.utils.checkpoint``): the backward pass keeps only the state entering each
segment and recomputes one segment at a time. Only the gradients of the outputs and the final states are taken;
checkpoint states (prefix caching) have no gradient in a training step.

``working_dtype`` gives the baseline the budgets of gradients are derived from (docs/tolerance.md): the chunked
algebra in float32 with every matmul operand and every stored intermediate rounded to that dtype, and the
gradient flowing back through each such store rounded to it too (a kernel's backward keeps its gradients at
the precision it keeps the activations).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kda_cases.materialize import KDAOptions
from kda_reference.chunked import DEFAULT_CHUNK, FACTORED_SPAN, TF32_OPERANDS, round_to_tf32
from kda_reference.prepared import _preprocess, check_inputs

GRADIENT_FORMS = ("loop", "chunked")
# The inputs a gradient is taken of, by the name of chunk_kda's argument; ``initial_state`` only where one is
# given, ``A_log`` and ``dt_bias`` only where the gate is computed in the kernel (and given).
GRADIENT_INPUTS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
# Tokens per checkpointed segment: the backward keeps one state per segment and one segment's intermediates.
SEGMENT_TOKENS = 1024


@dataclass(frozen=True)
class Gradients:
    """The gradient of each input, in the input's shape and layout (None where the call has no such input);
    float64 for the truth, float32 for the working-precision baseline."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    initial_state: torch.Tensor | None = None
    A_log: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None

    def items(self) -> list[tuple[str, torch.Tensor]]:
        """``(input name, gradient)`` of every input that has one, in GRADIENT_INPUTS' order."""
        return [(name, getattr(self, name)) for name in GRADIENT_INPUTS if getattr(self, name) is not None]


def kda_gradients(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    options: KDAOptions | None,
    d_o: torch.Tensor,
    d_final: torch.Tensor | None,
    *,
    form: str = "chunked",
    working_dtype: torch.dtype | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    segment_tokens: int = SEGMENT_TOKENS,
    tf32_dots: str | None = None,
) -> Gradients:
    """The gradients of ``sum(o * d_o) + sum(final_state * d_final)`` (``d_final`` None: the final states are
    not used) with ``kda_recurrent``'s arguments and conventions: ``d_o`` ``[B, T, HV, V]``, ``d_final`` in the
    state's shape and layout. ``form``: ``loop`` or ``chunked`` (float64 only: the loop is the definition);
    ``working_dtype`` (bfloat16, float16 or float32): the working-precision baseline, chunked, its matmul
    operands (and their gradients) rounded (``"nearest"``) or cut (``"truncated"``) to TF32 with ``tf32_dots``
    (reference/chunked.py)."""
    if form not in GRADIENT_FORMS:
        raise ValueError(f"form={form!r} is not allowed; choose from {', '.join(GRADIENT_FORMS)}")
    if working_dtype not in (None, torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"working_dtype must be None, bfloat16, float16 or float32, got {working_dtype}")
    if working_dtype is not None and form != "chunked":
        raise ValueError("the working-precision baseline is chunked: form='chunked' with a working_dtype")
    if tf32_dots not in (None, *TF32_OPERANDS):
        raise ValueError(f"tf32_dots must be None, {' or '.join(map(repr, TF32_OPERANDS))}, got {tf32_dots!r}")
    if tf32_dots is not None and working_dtype is None:
        raise ValueError("tf32_dots needs a working_dtype: the exact gradients compute in float64")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    if segment_tokens < 1:
        raise ValueError(f"segment_tokens must be a positive integer, got {segment_tokens}")
    options = options or KDAOptions()
    compute = torch.float64 if working_dtype is None else torch.float32
    store = working_dtype or compute
    raw = check_inputs(q, k, v, g, beta, options, compute)  # shapes, sequences and state checked once
    if tuple(d_o.shape) != tuple(v.shape):
        raise ValueError(f"d_o must have the outputs' shape {list(v.shape)}, got {list(d_o.shape)}")
    state_shape = (len(raw.bounds), *raw.h0.shape[1:])
    if options.state_v_first:
        state_shape = (*state_shape[:2], state_shape[3], state_shape[2])
    if d_final is not None and tuple(d_final.shape) != state_shape:
        raise ValueError(f"d_final must have the final states' shape {list(state_shape)}, got {list(d_final.shape)}")

    with torch.inference_mode(False), torch.enable_grad():  # a run computes in inference mode: out of it here
        tokens, extras = _leaves(q, k, v, g, beta, options, compute)
        wanted = {**tokens, **{name: leaf for name, leaf in extras.items() if leaf is not None}}
        given = dataclasses.replace(options, A_log=extras["A_log"], dt_bias=extras["dt_bias"])
        pq, pk, pv, pg, pbeta = _preprocess(
            tokens["q"], tokens["k"], tokens["v"], tokens["g"], tokens["beta"], given, compute
        )
        h0 = extras["initial_state"]
        if h0 is None:
            h0 = torch.zeros(state_shape, dtype=compute, device=q.device)
        h0 = h0.transpose(-1, -2) if options.state_v_first else h0
        d_o_ = d_o.to(compute, copy=True)  # copies: a tensor made in inference mode cannot be saved for backward
        d_final_ = None if d_final is None else d_final.to(compute, copy=True)
        if d_final_ is not None and options.state_v_first:
            d_final_ = d_final_.transpose(-1, -2)
        rounding = _Rounding(store, compute, tf32_dots)
        segment = _loop_segment if form == "loop" else _chunked_segment(chunk_size, rounding)
        o, final = _recurrence((pq, pk, pv, pg, pbeta), h0, raw.bounds, segment, segment_tokens)
        loss = (o * d_o_).sum()
        if d_final_ is not None:
            loss = loss + (final * d_final_).sum()
        grads = torch.autograd.grad(loss, list(wanted.values()), materialize_grads=True)
    return Gradients(**dict(zip(wanted, grads, strict=True)))


def differentiable_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    options: KDAOptions | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA in float32 that autograd can differentiate (the chunked algebra, unrounded): the outputs in q's dtype
    and the final states in float32, in the state's layout. A kernel in plain PyTorch, for tests of the
    gradient checks; the suite's truth is float64 (:func:`kda_gradients`)."""
    options = options or KDAOptions()
    raw = check_inputs(q, k, v, g, beta, options, torch.float32)
    prepared = _preprocess(q, k, v, g, beta, options, torch.float32)
    segment = _chunked_segment(chunk_size, _Rounding(torch.float32, torch.float32))
    o, final = _recurrence(prepared, raw.h0, raw.bounds, segment, SEGMENT_TOKENS)
    return o.to(q.dtype), final.transpose(-1, -2) if options.state_v_first else final


def _recurrence(
    prepared: tuple[torch.Tensor, ...],
    h0: torch.Tensor,
    bounds: list[tuple[int, int, int]],
    segment: Segment,
    segment_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs ``[B, T, HV, V]`` and the final states ``[N, HV, K, V]`` of the preprocessed inputs, each
    sequence a segment at a time, each segment checkpointed (only the state entering it is kept for the
    backward pass)."""
    q, k, v, g, beta = prepared
    rows: dict[int, list[torch.Tensor]] = {}
    finals = []
    for n, (row, start, end) in enumerate(bounds):
        S = h0[n]
        for s0 in range(start, end, segment_tokens):
            s1 = min(end, s0 + segment_tokens)
            piece = (x[row, s0:s1] for x in (q, k, v, g, beta))
            o, S = checkpoint(segment, *piece, S, use_reentrant=False)
            rows.setdefault(row, []).append(o)
        finals.append(S)
    o = torch.stack([torch.cat(rows[row]) for row in sorted(rows)])
    return o, torch.stack(finals)


def _leaves(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    options: KDAOptions,
    compute: torch.dtype,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None]]:
    """Every input a gradient is taken of, as given (each in its own dtype, exactly) but in ``compute``,
    detached and requiring a gradient: the token tensors q, k, v, g, beta, and the others (None where the call
    has none)."""

    def leaf(x: torch.Tensor) -> torch.Tensor:
        return x.detach().to(compute, copy=True).requires_grad_()

    gate = options.use_gate_in_kernel
    tokens = {"q": leaf(q), "k": leaf(k), "v": leaf(v), "g": leaf(g), "beta": leaf(beta)}
    extras = {
        "initial_state": options.initial_state,
        "A_log": options.A_log if gate else None,
        "dt_bias": options.dt_bias if gate else None,
    }
    return tokens, {name: None if x is None else leaf(x) for name, x in extras.items()}


@dataclass(frozen=True)
class _Rounding:
    """Where the working-precision baseline rounds, forward and backward alike; nothing in float64."""

    store: torch.dtype
    compute: torch.dtype
    tf32: str | None = None

    @property
    def exact(self) -> bool:
        """The float64 truth: no rounding, and the exact form's factored products and triangular solve."""
        return self.compute == torch.float64

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` stored in ``store`` and read back."""
        if self.store == self.compute:
            return x
        return _rounded(x, lambda y: y.to(self.store).to(y.dtype))

    def dot(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as a matmul takes it: rounded or cut to TF32 where the dots are TF32."""
        if self.tf32 is None:
            return x
        return _rounded(x, lambda y: round_to_tf32(y, truncate=self.tf32 == "truncated"))


def _rounded(x: torch.Tensor, rounded: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    return cast(torch.Tensor, _Rounded.apply(x, rounded))  # type: ignore[no-untyped-call]


class _Rounded(torch.autograd.Function):
    """A value rounded (stored at working precision and read back, or handed to a TF32 dot), and its gradient
    rounded the same way: what a kernel does in its forward and its backward pass."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rounded: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ctx.rounded = rounded
        return rounded(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.rounded(grad), None


def _loop_segment(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, S: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition on one segment of one sequence (``[L, HV, D]`` tensors, ``S`` K-first ``[HV, K, V]``):
    its outputs and the state after it, without an in-place update."""
    decay = torch.exp(g)
    outputs = []
    for t in range(q.shape[0]):
        S = S * decay[t].unsqueeze(-1)
        residual = v[t] - torch.einsum("hk,hkv->hv", k[t], S)
        S = S + torch.einsum("hk,hv->hkv", beta[t].unsqueeze(-1) * k[t], residual)
        outputs.append(torch.einsum("hk,hkv->hv", q[t], S))
    return torch.stack(outputs), S


Segment = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _chunked_segment(C: int, r: _Rounding) -> Segment:
    """The chunked algebra of ``reference/chunked.py`` on one segment of one sequence, with ``C``-token chunks
    and the rounding ``r``, written without in-place updates."""

    def segment(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, S: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        length = q.shape[0]
        # A segment shorter than a chunk is one chunk of its own length: padding rows are zeros and add nothing.
        size = min(C, length)
        n = math.ceil(length / size)
        pad = n * size - length

        def chunked(x: torch.Tensor) -> torch.Tensor:  # [L, HV, ...] -> [n, HV, C, D]; padding: zeros
            x = x if x.dim() == 3 else x.unsqueeze(-1)
            x = F.pad(x, (0, 0, 0, 0, 0, pad))
            return x.reshape(n, size, x.shape[1], x.shape[2]).transpose(1, 2)

        q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
        G = g.cumsum(dim=2)
        G_last = G[:, :, -1:, :]
        A, L = _intra(q, k, G, r)
        A = r(A.tril())
        # Masked before the product: above the diagonal the factored L may hold inf, and 0 * inf is a NaN gradient.
        L = L.tril(-1) * beta
        beta_k_decayed = beta * k * torch.exp(G)
        if r.exact:
            solved = torch.linalg.solve_triangular(
                L, torch.cat([beta * v, beta_k_decayed], -1), upper=False, unitriangular=True
            )
            u, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
        else:  # kernels invert I + L and store the inverse, u and w at their own precision
            eye = torch.eye(size, dtype=q.dtype, device=q.device).expand_as(L)
            inverse = r.dot(r(torch.linalg.solve_triangular(r.dot(L), eye, upper=False, unitriangular=True)))
            u, w = r(inverse @ r.dot(r(beta * v))), r(inverse @ r.dot(r(beta_k_decayed)))
        q_decayed = r(q * torch.exp(G))
        k_to_end = r(k * torch.exp(G_last - G)).transpose(-1, -2)  # [n, HV, K, C]
        decay_end = torch.exp(G_last).transpose(-1, -2)  # [n, HV, K, 1]
        entering, corrected = [], []
        for j in range(n):  # the only sequential part: the state entering each chunk
            entering.append(S)
            U = r(u[j] - r.dot(w[j]) @ r.dot(r(S)))
            corrected.append(U)
            S = decay_end[j] * S + r.dot(k_to_end[j]) @ r.dot(U)
        S_in, U = torch.stack(entering), torch.stack(corrected)
        o = r.dot(q_decayed) @ r.dot(r(S_in)) + r.dot(A) @ r.dot(U)  # [n, HV, C, V]
        return o.transpose(1, 2).reshape(n * size, o.shape[1], o.shape[-1])[:length], S

    return segment


def _intra(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, r: _Rounding) -> tuple[torch.Tensor, torch.Tensor]:
    """A (``q_t D_ts k_s``) and L (``k_t D_ts k_s``) of every chunk, ``D_ts = exp(G_t - G_s)``, unmasked. In
    float64 as two matmuls factored about the middle of each chunk's range of G, where that range fits (as
    ``reference/chunked.py``'s exact form); otherwise, and at working precision (as the kernels round them),
    from the pairwise decays themselves."""
    top = G.amax(dim=-2, keepdim=True).clamp(min=0)
    bottom = G.amin(dim=-2, keepdim=True).clamp(max=0)
    if r.exact and bool(((top - bottom) <= FACTORED_SPAN).all()):
        middle = ((top + bottom) / 2).detach()
        ahead, k_behind = torch.exp(G - middle), (k * torch.exp(middle - G)).transpose(-1, -2)
        return (q * ahead) @ k_behind, (k * ahead) @ k_behind
    C = G.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=G.device).tril()
    exponent = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~causal.unsqueeze(-1), -math.inf)  # [..., t, s, K]
    D = torch.exp(exponent)
    keys = r.dot(k).unsqueeze(-3)
    A = (r.dot(r(q.unsqueeze(-2) * D)) * keys).sum(-1)
    L = (r.dot(r(k.unsqueeze(-2) * D)) * keys).sum(-1)
    return A, L
