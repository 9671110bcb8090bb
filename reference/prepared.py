"""Validation and preprocessing shared by every form of the reference.

Both the token loop (the definition) and the chunked form start from the same
prepared tensors, so they can only differ in how they run the recurrence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kda_cases.case import sequence_bounds
from kda_cases.materialize import KDAOptions
from kda_reference.preprocess import beta_activation, gate_activation, l2norm


@dataclass(frozen=True)
class Prepared:
    """Inputs after preprocessing, in one compute dtype, q and k expanded to the value heads.

    ``q`` is already scaled; ``g`` is the per-key log decay; ``h0`` is K-first
    ``[N, HV, K, V]`` (zeros where no initial state was given).
    """

    q: torch.Tensor  # [B, T, HV, K]
    k: torch.Tensor  # [B, T, HV, K]
    v: torch.Tensor  # [B, T, HV, V]
    g: torch.Tensor  # [B, T, HV, K]
    beta: torch.Tensor  # [B, T, HV]
    h0: torch.Tensor  # [N, HV, K, V]
    bounds: list[tuple[int, int, int]]
    checkpoints: tuple[tuple[int, int], ...]
    state_v_first: bool


@dataclass(frozen=True)
class Raw:
    """Checked inputs before preprocessing: the blockwise chunked form preprocesses a block of chunks at a
    time (``rows``), so that no full-length float64 copy of the inputs is ever held."""

    q: torch.Tensor  # [B, T, H, K], as given
    k: torch.Tensor  # [B, T, H, K]
    v: torch.Tensor  # [B, T, HV, V]
    g: torch.Tensor  # [B, T, HV, K]
    beta: torch.Tensor  # [B, T, HV]
    options: KDAOptions
    dtype: torch.dtype
    h0: torch.Tensor  # [N, HV, K, V] in ``dtype``, K-first
    bounds: list[tuple[int, int, int]]
    checkpoints: tuple[tuple[int, int], ...]

    @property
    def state_v_first(self) -> bool:
        return self.options.state_v_first

    def prepared(self) -> Prepared:
        """Every token preprocessed in ``dtype`` at once (the token loop's form)."""
        q, k, v, g, beta = _preprocess(self.q, self.k, self.v, self.g, self.beta, self.options, self.dtype)
        return Prepared(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            h0=self.h0,
            bounds=self.bounds,
            checkpoints=self.checkpoints,
            state_v_first=self.state_v_first,
        )

    def rows(self, index: torch.Tensor, whole: bool = False) -> tuple[torch.Tensor, ...]:
        """q, k, v, g, beta of the flat tokens ``index`` (``[n, HV, D]``) preprocessed in ``dtype`` as
        ``prepared`` does, q and k expanded to the value heads; an index of ``B*T`` (one past the tokens) is
        a padding row of zeros. ``whole``: the index covers every token, and the inputs are preprocessed as
        given before the gather (elementwise kernels on strided and gathered tensors may round their last
        bit differently, and the baseline's bits must not move)."""
        B, T = self.q.shape[:2]
        tensors = (self.q, self.k, self.v, self.g, self.beta)
        if whole:
            done = [x.reshape(B * T, *x.shape[2:]) for x in _preprocess(*tensors, self.options, self.dtype)]
            done = [torch.cat([x, x.new_zeros(1, *x.shape[1:])]) for x in done]
            return tuple(x[index] for x in done)
        padding = index == B * T
        at = index.clamp(max=B * T - 1)
        q, k, v, g, beta = (x.reshape(B * T, *x.shape[2:])[at] for x in tensors)
        zero = torch.zeros((), dtype=self.dtype, device=index.device)
        return tuple(
            torch.where(padding.reshape(-1, *([1] * (x.dim() - 1))), zero, x)
            for x in _preprocess(q, k, v, g, beta, self.options, self.dtype)
        )


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    options: KDAOptions,
    dtype: torch.dtype,
) -> Raw:
    """Check shapes and arguments with chunk_kda's conventions; nothing preprocessed yet."""
    o = options
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if HV % H != 0:
        raise ValueError(f"num_v_heads (HV={HV}) must be a multiple of num_heads (H={H})")
    if v.shape[:2] != (B, T) or g.shape != (B, T, HV, K) or beta.shape != (B, T, HV):
        raise ValueError(
            f"expected v [B,T,HV,V], g [B,T,HV,K]={[B, T, HV, K]}, beta [B,T,HV]={[B, T, HV]}; "
            f"got v {list(v.shape)}, g {list(g.shape)}, beta {list(beta.shape)}"
        )
    bounds = sequence_bounds(B, T, o.cu_seqlens)
    N = len(bounds)
    state_shape = (N, HV, V, K) if o.state_v_first else (N, HV, K, V)
    if o.initial_state is not None and tuple(o.initial_state.shape) != state_shape:
        raise ValueError(f"initial_state must have shape {list(state_shape)}, got {list(o.initial_state.shape)}")
    for index, (seq, tokens) in enumerate(o.checkpoints):
        if not 0 <= seq < N:
            raise ValueError(f"checkpoint {index} names sequence {seq}; there are {N} sequences")
        length = bounds[seq][2] - bounds[seq][1]
        if not 0 <= tokens <= length:
            raise ValueError(
                f"checkpoint {index} asks for the state after {tokens} tokens of a {length}-token sequence"
            )
    if o.initial_state is None:
        h0 = torch.zeros(N, HV, K, V, dtype=dtype, device=q.device)
    else:
        h0 = o.initial_state.to(dtype)
        h0 = h0.transpose(-1, -2).contiguous() if o.state_v_first else h0.clone()
    checkpoints = tuple((int(s), int(p)) for s, p in o.checkpoints)
    return Raw(q, k, v, g, beta, options=o, dtype=dtype, h0=h0, bounds=bounds, checkpoints=checkpoints)


def _preprocess(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    o: KDAOptions,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, ...]:
    """The kernels' preprocessing in ``dtype`` on ``[..., heads, D]`` tensors; q and k expanded to the value
    heads (every operation is per token, so a block of tokens gives the bits the whole input would)."""
    K, HV = q.shape[-1], v.shape[-2]
    scale = K**-0.5 if o.scale is None else o.scale
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if o.use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    beta = beta_activation(beta, o.use_beta_sigmoid_in_kernel)
    g = gate_activation(g, in_kernel=o.use_gate_in_kernel, A_log=o.A_log, dt_bias=o.dt_bias, lower_bound=o.lower_bound)
    group = HV // q.shape[-2]
    return (q * scale).repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2), v, g, beta
