"""The zoo of planted-bug backends: each wraps a correct backend (the torch_chunk baseline) and models one
bug class seen in real KDA kernels or their serving glue (KDA-FACTS.md, "Known bugs and hazards").

The suite's own tests load it with ``--kda-plugin kda_planted_bugs`` and require the ``ci`` profile to flag
every one of them (tests/test_planted_bugs.py); ``kda-conformance detection`` tabulates which property
caught each and after how many cases (docs/detection.md). The bugs that need a paged state pool (a
padding row scattering into slot 0, -1 remapped onto a live slot) belong to the serving harness.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

import torch

from kda_cases.dtypes import stored_dtype
from kda_cases.guards import memory_of
from kda_cases.materialize import KDAInputs, cu_seqlens_tensor, materialize
from kda_conformance.checks._derived import token_slice
from kda_kernels.protocol import BackendOutput
from kda_kernels.registry import register
from kda_kernels.serving import gather_run_scatter
from kda_kernels.torch_chunk import TorchChunk
from kda_reference.preprocess import gate_activation

PIECE = 64  # the chunk size at which the piecewise bugs carry their state
SEGMENT = 2048  # FlashKDA's segment: 64 chunks of 32 tokens
NAN_TOKEN = 33  # just past a 32-token chunk boundary
TABLE = 8  # entries of the per-sequence table that wraps
GRID = 128  # (sequence, value head) programs of the grid that drops the rest

# name -> (the bug it models, where it was seen)
ZOO: dict[str, tuple[str, str]] = {}


def planted(name: str, models: str, seen: str) -> Callable[[type[TorchChunk]], type[TorchChunk]]:
    """Register a planted-bug backend under ``name`` and note what it models."""

    def wrap(cls: type[TorchChunk]) -> type[TorchChunk]:
        cls.name, cls.description = name, models
        # A forward bug: its backward is the baseline's, which the gradients check needs no time to confirm
        # (the backward bugs are tests/plugins/kda_planted_backward.py's).
        cls.envelope = dataclasses.replace(cls.envelope, backward=False)
        ZOO[name] = (models, seen)
        register(name, cls)
        return cls

    return wrap


def log_decay(inputs: KDAInputs) -> torch.Tensor:
    """The per-token, per-key log decay the case's gate yields, in float32: ``[B, T, HV, K]``."""
    case = inputs.case
    return gate_activation(
        inputs.g.float(),
        in_kernel=case.gate_in_kernel,
        A_log=inputs.A_log,
        dt_bias=inputs.dt_bias,
        lower_bound=case.lower_bound,
    )


def with_log_gate(inputs: KDAInputs, g: torch.Tensor) -> KDAInputs:
    """The same inputs with the gate handed over as a precomputed log decay ``g`` (float32)."""
    return dataclasses.replace(inputs, g=g.float(), case=inputs.case.replace(gate="log"))


def state_scale(h: torch.Tensor, per_key: torch.Tensor, v_first: bool) -> torch.Tensor:
    """``h`` scaled along its key axis by ``per_key [N, HV, K]``, in either state layout."""
    return h * (per_key[..., None, :] if v_first else per_key[..., :, None])


def run_in_pieces(
    base: TorchChunk,
    inputs: KDAInputs,
    carry: Callable[[torch.Tensor, torch.Tensor | None, KDAInputs], torch.Tensor],
) -> BackendOutput:
    """Run each sequence ``PIECE`` tokens at a time, handing ``carry(final, initial, piece)`` on as the
    next piece's initial state: the shape of a kernel whose bug sits at its chunk boundaries."""
    case = inputs.case
    o = torch.zeros_like(inputs.v, dtype=stored_dtype(case, "o"))
    if case.packed:
        groups = [(n, n + 1, start, end) for n, (_, start, end) in enumerate(case.row_spans)]
    else:
        groups = [(0, case.num_seqs, 0, case.seq_lens[0])]
    HV, K, V = case.num_v_heads, case.head_k_dim, case.head_v_dim
    state_shape = (HV, V, K) if case.state_v_first else (HV, K, V)
    finals = []
    for lo, hi, start, end in groups:
        h = None if inputs.initial_state is None else inputs.initial_state[lo:hi]
        for a in range(start, end, PIECE):
            b = min(a + PIECE, end)
            piece = token_slice(
                inputs, a, b, h, case.replace(seq_lens=(b - a,) * (hi - lo), packed=False, checkpoints=())
            )
            out = base.run(piece)
            o[:, a:b] = out.o
            h = carry(out.final_state, h, piece)
        if h is None:  # a zero-length sequence with no initial state
            h = torch.zeros((hi - lo, *state_shape), dtype=stored_dtype(case, "final_state"), device=inputs.device)
        finals.append(h)
    return BackendOutput(o=o, final_state=torch.cat(finals), checkpoint_states=None)


@planted(
    "planted_fresh_reads_stale_slot",
    "a fresh sequence (no initial state) starts from a previous tenant's state instead of zeros",
    "vLLM #51562/#51565, #56524",
)
class FreshReadsStaleSlot(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        if inputs.initial_state is not None:
            return super().run(inputs)
        tenant = inputs.case.replace(initial_state="random", seed=inputs.case.seed + 7919)
        return super().run(dataclasses.replace(inputs, initial_state=materialize(tenant, inputs.device).initial_state))


@planted(
    "planted_state_to_wrong_slot",
    "each sequence's final state is written to the next sequence's slot",
    "vLLM #43090, sglang #31474",
)
class StateToWrongSlot(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        return dataclasses.replace(out, final_state=torch.roll(out.final_state, 1, dims=0))


@planted(
    "planted_no_decay_at_chunk_boundary",
    "the state carried into the next 64-token chunk misses that chunk's decay",
    "the chunk recurrence S_C = exp(G_C) S_0 + ... written without exp(G_C)",
)
class NoDecayAtChunkBoundary(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        v_first = inputs.case.state_v_first

        def carry(final: torch.Tensor, h: torch.Tensor | None, piece: KDAInputs) -> torch.Tensor:
            if h is None:
                return final
            decay = torch.exp(log_decay(piece).sum(dim=1))  # [rows, HV, K]
            return (final.float() + state_scale(h.float(), 1 - decay, v_first)).to(final.dtype)

        return run_in_pieces(super(), inputs, carry)


@planted(
    "planted_packed_state_leak",
    "a packed batch runs as one long sequence: each sequence starts from the previous one's state",
    "cu_seqlens ignored by a state-passing kernel",
)
class PackedStateLeak(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        if inputs.cu_seqlens is None:
            return super().run(inputs)
        case = inputs.case
        whole = case.replace(seq_lens=(case.total_tokens,), packed=False, checkpoints=())
        h0 = None if inputs.initial_state is None else inputs.initial_state[:1]
        out = super().run(dataclasses.replace(inputs, case=whole, cu_seqlens=None, initial_state=h0))
        final = out.final_state.expand(case.num_seqs, *out.final_state.shape[1:]).contiguous()
        return BackendOutput(o=out.o, final_state=final)


@planted(
    "planted_bf16_state_carry",
    "the state is carried between 64-token chunks in bf16",
    "a state buffer allocated in the input dtype",
)
class Bf16StateCarry(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        def carry(final: torch.Tensor, h: torch.Tensor | None, piece: KDAInputs) -> torch.Tensor:
            return final.to(torch.bfloat16).to(final.dtype)

        return run_in_pieces(super(), inputs, carry)


@planted(
    "planted_exp2_on_natural_log_gates",
    "decays computed with exp2 on natural-log cumulative gates (2^G instead of e^G)",
    "sglang #31904",
)
class Exp2OnNaturalLogGates(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        return super().run(with_log_gate(inputs, log_decay(inputs) * math.log(2.0)))


@planted(
    "planted_transposed_state",
    "reads and writes the state in the other layout (K-first for V-first and back)",
    "vLLM #41292",
)
class TransposedState(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        h0 = inputs.initial_state
        flipped = None if h0 is None else h0.transpose(-1, -2).contiguous()
        out = super().run(dataclasses.replace(inputs, initial_state=flipped))
        return BackendOutput(
            o=out.o,
            final_state=out.final_state.transpose(-1, -2).contiguous(),
            checkpoint_states=out.checkpoint_states.transpose(-1, -2).contiguous(),
        )


@planted(
    "planted_clamped_softplus_gate",
    "the safe gate as max(-exp(A) softplus(g + dt_bias), lb) instead of lb sigmoid(exp(A) (g + dt_bias))",
    "tokenspeed PR #847",
)
class ClampedSoftplusGate(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        case = inputs.case
        if case.gate != "lower_bound":
            return super().run(inputs)
        HV, K = case.num_v_heads, case.head_k_dim
        x = inputs.g.float() + (0 if inputs.dt_bias is None else inputs.dt_bias.float().reshape(HV, K))
        rate = 1.0 if inputs.A_log is None else torch.exp(inputs.A_log.float()).reshape(HV, 1)
        g = (-rate * torch.nn.functional.softplus(x)).clamp(min=case.lower_bound)
        return super().run(with_log_gate(inputs, g))


@planted(
    "planted_future_leak",
    "each output also sees 1 % of the next token's value",
    "FLA #1240 (safe_gate anchor, fixed in 0.6.0)",
)
class FutureLeak(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        o = out.o.clone()
        # Beyond the output's limit: a causal leak even where it stays inside the chunk of the changed token
        # (a change within the limit inside that chunk is only "not batch-invariant").
        o[:, :-1] += (1e-2 * inputs.v[:, 1:]).to(o.dtype)
        return dataclasses.replace(out, o=o)


def contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@planted(
    "planted_reads_strided_as_contiguous",
    "reads q, k, v, g and beta from their first element with contiguous strides: views of a fused projection "
    "read their neighbours' values",
    "kernels that index from data_ptr with strides of their own (FLA's input_guard makes inputs contiguous)",
)
class ReadsStridedAsContiguous(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        misread = {
            name: x.as_strided(x.shape, contiguous_strides(x.shape), x.storage_offset())
            for name in ("q", "k", "v", "g", "beta")
            if (x := getattr(inputs, name)) is not None
        }
        return super().run(dataclasses.replace(inputs, **misread))


@planted(
    "planted_clamps_large_values",
    "clamps |v| at 64 before the recurrence (a saturating cast or a clamp sized for typical activations)",
    "fp8 / int8 quantised value paths; kernels sized on N(0, 1) test inputs",
)
class ClampsLargeValues(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        return super().run(dataclasses.replace(inputs, v=inputs.v.clamp(-64, 64)))


@planted(
    "planted_sequence_table_wraps_past_8",
    f"a per-sequence table of {TABLE} entries indexed modulo its size: sequence n >= {TABLE} writes its final "
    f"state over sequence n mod {TABLE}'s and leaves its own zero",
    "fixed-size per-request metadata (a launch's small argument array, a captured graph's tables)",
)
class SequenceTableWraps(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        count = out.final_state.shape[0]
        if count <= TABLE:
            return out
        final = out.final_state.clone()
        for seq in range(TABLE, count):
            final[seq % TABLE] = out.final_state[seq]
            final[seq] = 0
        return dataclasses.replace(out, final_state=final)


@planted(
    "planted_drops_programs_past_128",
    f"a grid of at most {GRID} (sequence, value head) programs: the pairs past it are never computed (their "
    "outputs and final states left zero)",
    "a per-(sequence, head) grid dimension sized on test batches",
)
class DropsProgramsPast128(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        case = inputs.case
        heads = case.num_v_heads
        if case.num_seqs * heads <= GRID:
            return out
        o, final = out.o.clone(), out.final_state.clone()
        for program in range(GRID, case.num_seqs * heads):
            seq, head = divmod(program, heads)
            row, start, end = case.row_spans[seq]
            o[row, start:end, head] = 0
            final[seq, head] = 0
        return dataclasses.replace(out, o=o, final_state=final)


@planted(
    "planted_keeps_state_between_calls",
    "right on its first call; every later call's output carries 5 % of the previous call's mean |final state| "
    "(a workspace kept between launches and never cleared)",
    "persistent scratch and CUDA-graph buffers reused across calls",
)
class KeepsStateBetweenCalls(TorchChunk):
    def __init__(self) -> None:
        super().__init__()
        self.left: float | None = None

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        previous, self.left = self.left, float(out.final_state.float().abs().mean())
        if previous is None:
            return out
        return dataclasses.replace(out, o=(out.o.float() + 0.05 * previous).to(out.o.dtype))


@planted(
    "planted_wrong_past_2048",
    "outputs from packed position 2048 on (FlashKDA's second segment) are 3 % off",
    "segment hand-over bugs; AITER #4683 class",
)
class WrongPast2048(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        o = out.o.clone()
        o[:, SEGMENT:] *= 1 + 1 / 32
        return dataclasses.replace(out, o=o)


@planted(
    "planted_nan_at_one_position",
    f"a NaN at token {NAN_TOKEN}, head 0, of the first row",
    "vLLM #51039 class (NaN after long prefills); AITER's xf32 NaN",
)
class NanAtOnePosition(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        if out.o.shape[1] <= NAN_TOKEN:
            return out
        o = out.o.clone()
        o[0, NAN_TOKEN, 0, 0] = math.nan
        return dataclasses.replace(out, o=o)


@planted(
    "planted_checkpoint_off_by_one",
    "each checkpoint state is taken one token late (one early at the sequence end)",
    "vLLM #53212 / #43090 (prefix-cache checkpoints)",
)
class CheckpointOffByOne(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        case = inputs.case
        if not case.checkpoints:
            return super().run(inputs)
        late = tuple((s, p + 1 if p < case.seq_lens[s] else max(0, p - 1)) for s, p in case.checkpoints)
        return super().run(dataclasses.replace(inputs, case=case.replace(checkpoints=late)))


@planted(
    "planted_unwritten_output_tail",
    "output rows of each row's last partial 64-token chunk are never written (left as zeros)",
    "sglang #30974; FlashKDA's torch.empty_like output",
)
class UnwrittenOutputTail(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        full = out.o.shape[1] // PIECE * PIECE
        if full == out.o.shape[1]:
            return out
        o = out.o.clone()
        o[:, full:] = 0
        return dataclasses.replace(out, o=o)


@planted(
    "planted_zero_length_shifts_sequences",
    "a zero-length sequence in cu_seqlens shifts every later sequence onto the wrong state slot",
    "AITER (read from code): chunk indices built without empty sequences",
)
class ZeroLengthShiftsSequences(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        case = inputs.case
        kept = [n for n, length in enumerate(case.seq_lens) if length]
        if not case.packed or len(kept) == case.num_seqs:
            return super().run(inputs)
        h0 = inputs.initial_state
        compact = case.replace(seq_lens=tuple(case.seq_lens[n] for n in kept), checkpoints=())
        cu = cu_seqlens_tensor(compact, inputs.device, dtype=inputs.cu_seqlens.dtype)
        out = super().run(
            dataclasses.replace(
                inputs, case=compact, cu_seqlens=cu, initial_state=None if h0 is None else h0[: len(kept)]
            )
        )
        final = torch.zeros_like(out.final_state[:1]).expand(case.num_seqs, *out.final_state.shape[1:]).clone()
        final[: len(kept)] = out.final_state  # the first slots, not the sequences' own
        return BackendOutput(o=out.o, final_state=final, checkpoint_states=None)


@planted(
    "planted_bf16_gate_cumsum",
    "the cumulative log decay is summed in bf16",
    "gate cumsum kept in the input dtype",
)
class Bf16GateCumsum(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        g = log_decay(inputs)
        cumulative = g.cumsum(dim=1).to(torch.bfloat16).float()
        start = torch.zeros_like(cumulative[:, :1])
        return super().run(with_log_gate(inputs, torch.diff(cumulative, dim=1, prepend=start)))


@planted(
    "planted_ignores_initial_state",
    "drops the initial state: a resumed request starts from zeros",
    "vLLM #53212 (unwritten checkpoint restored)",
)
class IgnoresInitialState(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        return super().run(dataclasses.replace(inputs, initial_state=None))


@planted(
    "planted_reads_past_the_end_of_g",
    "the last token's gate row is loaded 4 elements late: its last 4 keys read past the end of g",
    "FLA #1134: fused_recurrent_kda reads g out of bounds for K not a power of two (60, 100)",
)
class ReadsPastTheEndOfG(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        g, last = inputs.g, inputs.g[-1, -1]
        late = memory_of(g).as_strided(last.shape, last.stride(), last.storage_offset() + 4)
        read = g.clone()
        read[-1, -1] = late  # whatever lies past the end: a guard band's poison, or a fused neighbour's values
        return super().run(dataclasses.replace(inputs, g=read))


@planted(
    "planted_drops_heads_past_full_tiles_of_4",
    "value heads in tiles of 4, the grid HV // 4 tiles: the heads of a partial last tile are never computed",
    "head counts a tensor-parallel split leaves (48 heads over 8 ranks: 6), beside powers of two",
)
class DropsHeadsPastFullTilesOf4(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        done = inputs.case.num_v_heads // 4 * 4  # heads past it: zero output, zero final state
        o, final = out.o.clone(), out.final_state.clone()
        o[:, :, done:] = 0
        final[:, done:] = 0
        checkpoints = None if out.checkpoint_states is None else out.checkpoint_states.clone()
        if checkpoints is not None:
            checkpoints[:, done:] = 0
        return BackendOutput(o=o, final_state=final, checkpoint_states=checkpoints)


@planted(
    "planted_reads_fp32_gate_as_token_dtype",
    "reads g with the tokens' element size: a float32 gate beside bf16 or fp16 tokens is read as their halves",
    "servers hand float32 g and beta beside bf16 tokens (fused_kda_gate's float32 output; vLLM's Kimi layer)",
)
class ReadsFp32GateAsTokenDtype(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        g, dtype = inputs.g, inputs.q.dtype
        if g.dtype == dtype:
            return super().run(inputs)
        halves = g.contiguous().view(dtype)[..., : g.shape[-1]]  # a pointer stepping 2 bytes through 4-byte values
        return super().run(dataclasses.replace(inputs, g=halves.float()))


@planted(
    "planted_l2norm_without_eps",
    "the in-kernel l2norm divides by the norm with no epsilon: a zero q or k token is 0/0, NaN through the state",
    "zero token rows of a zero-filled static buffer (SGLang's KDA prefill graph pads its bucket with them)",
)
class L2normWithoutEps(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        if not inputs.case.l2norm_in_kernel:
            return super().run(inputs)

        def unit(x: torch.Tensor) -> torch.Tensor:
            return (x.float() / x.float().norm(dim=-1, keepdim=True)).to(x.dtype)

        # Normalized here, as the kernel would have; the baseline then takes them as they are.
        case = inputs.case.replace(l2norm_in_kernel=False)
        return super().run(dataclasses.replace(inputs, case=case, q=unit(inputs.q), k=unit(inputs.k)))


# Serving glue: backends with an in-place paged API (``run_paged``), each correct but for one bug.


class PagedBaseline(TorchChunk):
    """The baseline behind a paged API: gather, run, scatter, as the harness does for any backend."""

    def run_paged(self, batch, pool, state_indices, has_initial_state, out, checkpoint_slots) -> None:
        gather_run_scatter(self, batch, pool, state_indices, has_initial_state, out, checkpoint_slots)


@planted(
    "planted_pool_fresh_reads_slot",
    "a fresh sequence's initial state is read from its pool slot (has_initial_state ignored)",
    "vLLM #51562/#51565 (stateless first chunk classified as decode)",
)
class PoolFreshReadsSlot(PagedBaseline):
    def run_paged(self, batch, pool, state_indices, has_initial_state, out, checkpoint_slots) -> None:
        everyone = torch.ones_like(has_initial_state)
        super().run_paged(batch, pool, state_indices, everyone, out, checkpoint_slots)


@planted(
    "planted_padding_writes_slot0",
    "padding entries (PAD_SLOT_ID) clamp to slot 0 and scatter a state into it",
    "KDA-FACTS: padding rows scatter into slot 0",
)
class PaddingWritesSlot0(PagedBaseline):
    def run_paged(self, batch, pool, state_indices, has_initial_state, out, checkpoint_slots) -> None:
        super().run_paged(batch, pool, state_indices, has_initial_state, out, checkpoint_slots)
        padding = state_indices[batch.case.num_seqs :].long()
        pool[padding.clamp(min=0)] = 0


@planted(
    "planted_pad_wraps_to_last_slot",
    "PAD_SLOT_ID (-1) used as an index: padding entries write the pool's last slot",
    "sglang #36880/#38997 (PAD -1 remapped onto a live slot)",
)
class PadWrapsToLastSlot(PagedBaseline):
    pad_slot_ids = (-1,)  # SGLang's sentinel, the one this bug class comes from

    def run_paged(self, batch, pool, state_indices, has_initial_state, out, checkpoint_slots) -> None:
        super().run_paged(batch, pool, state_indices, has_initial_state, out, checkpoint_slots)
        pool[state_indices[batch.case.num_seqs :].long()] = 0  # -1 wraps to the last slot


@planted(
    "planted_null_slot_padding_as_a_slot",
    "only -1 marks padding: entries with vLLM's sentinel 0 are served as sequences, scattering into slot 0",
    "vLLM PR #35431 (padding state indices became NULL_BLOCK_ID = 0; kernels that test for -1 miss them)",
)
class NullSlotPaddingAsASlot(PagedBaseline):
    def run_paged(self, batch, pool, state_indices, has_initial_state, out, checkpoint_slots) -> None:
        super().run_paged(batch, pool, state_indices, has_initial_state, out, checkpoint_slots)
        padding = state_indices[batch.case.num_seqs :].long()
        pool[padding[padding >= 0]] = 0  # an empty fresh sequence's final state, into the slot it names


@planted(
    "planted_checkpoint_slot_unwritten",
    "checkpoint states are computed but never written to their slots",
    "vLLM #53212 (prefix-cache hit restores an unwritten checkpoint)",
)
class CheckpointSlotUnwritten(PagedBaseline):
    def run_paged(self, batch, pool, state_indices, has_initial_state, out, checkpoint_slots) -> None:
        keep = pool[checkpoint_slots.long()].clone()
        super().run_paged(batch, pool, state_indices, has_initial_state, out, checkpoint_slots)
        pool[checkpoint_slots.long()] = keep


@planted(
    "planted_uninitialised_output_tail",
    "the output is built in torch.empty and copied whole into the caller's buffer, tail rows included",
    "sglang #30974, FlashKDA's torch.empty_like output",
)
class UninitialisedOutputTail(PagedBaseline):
    def run_paged(self, batch, pool, state_indices, has_initial_state, out, checkpoint_slots) -> None:
        scratch = torch.empty_like(out)
        super().run_paged(batch, pool, state_indices, has_initial_state, scratch, checkpoint_slots)
        out.copy_(scratch)


@planted(
    "planted_pool_dense_addressing",
    "addresses pool slot i at i x (one slot's elements) on the pool's memory, not by the pool's own slot stride",
    "AITER's paged API docstring: stride(0) may be padded (vLLM's hybrid allocator pads linear-attention pages)",
)
class PoolDenseAddressing(PagedBaseline):
    def run_paged(self, batch, pool, state_indices, has_initial_state, out, checkpoint_slots) -> None:
        dense = memory_of(pool)[pool.storage_offset() : pool.storage_offset() + pool.numel()].view(pool.shape)
        super().run_paged(batch, dense, state_indices, has_initial_state, out, checkpoint_slots)


@planted(
    "planted_out_from_storage_start",
    "writes its output from the start of the caller's buffer's memory, not at the out slice it was handed",
    "a layer's prefill rows after its decode rows in one buffer (core_attn_out[num_decodes:])",
)
class OutFromStorageStart(PagedBaseline):
    def run_paged(self, batch, pool, state_indices, has_initial_state, out, checkpoint_slots) -> None:
        start = memory_of(out)[: out.numel()].view(out.shape)
        super().run_paged(batch, pool, state_indices, has_initial_state, start, checkpoint_slots)


@planted(
    "planted_cu_seqlens_identity_cache",
    "sequence bounds cached on the identity of the cu_seqlens tensor: a reused tensor gets stale bounds",
    "AITER (read from code): chunk indices cached by tensor identity",
)
class CuSeqlensIdentityCache(PagedBaseline):
    def __init__(self) -> None:
        super().__init__()
        # Keyed on the tensor's identity, as FLA's and AITER's tensor_cache are; like theirs, the cache holds
        # the tensor itself, so its id cannot pass to another tensor once it is freed.
        self.cached: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def run_paged(self, batch, pool, state_indices, has_initial_state, out, checkpoint_slots) -> None:
        super().run_paged(batch, pool, state_indices, has_initial_state, out, checkpoint_slots)
        _, cached = self.cached.setdefault(id(batch.cu_seqlens), (batch.cu_seqlens, batch.cu_seqlens.clone()))
        if torch.equal(cached, batch.cu_seqlens):
            return
        # The outputs come from the first batch's sequence bounds (its states from the right ones).
        stale = batch.case.replace(seq_lens=tuple(b - a for a, b in itertools.pairwise(cached.tolist())))
        old = dataclasses.replace(batch, case=stale, cu_seqlens=cached, initial_state=None)
        out[:, : batch.case.total_tokens] = self.run(old).o
