"""How the servers' KDA layers call their vendored copies of FLA's chunk kernels, read from their code
(docs/serving.md): the arguments, the gate and beta handling, the state gathered from the pool (zeros for a
fresh sequence) and the layout it is kept in, the host-built chunk tables of SGLang's graph prefill.

It imports nothing of kda-conformance: the vendored backends (kernels/backends/vendored.py) call these with a
case's inputs, and a standalone repro file for a server's kernels (conformance/repro/standalone_finding.py)
carries this module verbatim, so the call its maintainer runs is the one the suite judged. ``kda`` is the
server's loaded kda module (kernels/server_stubs.py loads one from a source tree); every function returns
``(o, final states)``, the states in the layout the kernels keep (``v_first``: ``[N, H, V, K]``).
"""

from __future__ import annotations

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
