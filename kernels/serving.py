"""Run a backend the way a server does: a paged recurrent-state pool, slot indices, padding, a caller's buffer.

A server keeps each request's recurrent state in a slot of a pool ``[slots, HV, K, V]`` (``[slots, HV, V, K]``
for V-first cases; fp32 or bf16), addressed per sequence by ``state_indices``. Slot 0 is the null block no
request owns; padding entries, which own nothing and must write nothing, carry a sentinel: ``-1`` (SGLang's
``PAD_SLOT_ID``) or ``0`` (vLLM's ``NULL_BLOCK_ID`` since its PR #35431), one per case from those the backend
declares (``Backend.pad_slot_ids``). A fresh
sequence (``has_initial_state`` False) starts from zeros and must never read its slot; its final state is
written there. Checkpoint states (prefix caching) go to slots of their own. A case's ``pool_layout`` says how
the slots lie in memory: one after another (``dense``), or in pages padded past one slot (``padded``: a
``torch.as_strided`` view whose slot stride is larger than a slot, each slot's own plane dense, as vLLM's
hybrid allocator pages a linear-attention layer), the gaps between slots poisoned like any memory the kernel
must not use. The output goes into the caller's buffer: a slice of a larger buffer at an offset (a layer's
prefill rows after its decode rows), which may run past the tokens; the rows before and after it are someone
else's.

A backend with an in-place paged API implements ``run_paged`` with the signature below and is called
directly. Any other backend is run the way vLLM's Triton path runs one: gather the initial states (zeros for
fresh sequences, never their slot), run, scatter the final and checkpoint states, copy the output rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kda_cases.case import Case
from kda_cases.dtypes import INT_OF_SIZE, stored_dtype
from kda_cases.guards import memory_of
from kda_cases.materialize import KDAInputs, cu_seqlens_tensor
from kda_kernels.guard import fault, run_backend_call, run_paged_call
from kda_kernels.protocol import Backend, BackendOutput

PAD_SLOT_ID = -1
NULL_SLOT = 0
# The sentinels servers give padding entries: SGLang's PAD_SLOT_ID, vLLM's NULL_BLOCK_ID (the null slot).
PAD_SLOT_IDS = (PAD_SLOT_ID, NULL_SLOT)
POISON_MODES = ("none", "nan", "inf", "sentinel", "garbage", "tenant")
SENTINEL = 1e30


@dataclass(frozen=True)
class PoolPlan:
    """Which slot holds what, for one batch: every sequence's slot, every checkpoint's, the padding; how the
    slots lie in memory, and where the caller's output slice lies in its buffer."""

    num_slots: int
    seq_slots: tuple[int, ...]
    checkpoint_slots: tuple[int, ...]  # one per case checkpoint, in the case's order
    padding: int  # PAD_SLOT_ID entries after the sequences (zero-length in cu_seqlens)
    out_rows: int  # rows of the caller's output buffer: the tokens, then a tail no sequence owns
    slot_padding: int = 0  # elements between one slot's end and the next one's start (0: a dense pool)
    out_offset: int = 0  # rows of the caller's larger buffer before its output slice (someone else's)
    out_after: int = 0  # and after it

    def state_indices(self, pad_slot_id: int = PAD_SLOT_ID) -> tuple[int, ...]:
        return (*self.seq_slots, *(pad_slot_id,) * self.padding)

    @property
    def named_slots(self) -> set[int]:
        return set(self.seq_slots) | set(self.checkpoint_slots)

    @property
    def unnamed_slots(self) -> list[int]:
        """Slots no sequence or checkpoint names (slot 0 included): nothing may write them."""
        return [s for s in range(self.num_slots) if s not in self.named_slots]


def plan_pool(case: Case, spare_slots: int = 3, padding: int = 2, tail_rows: int = 5) -> PoolPlan:
    """A pool for ``case``'s sequences and checkpoints, in shuffled slots (seeded by the case), with spare
    slots nobody names, slot 0 reserved, ``padding`` PAD entries and ``tail_rows`` output rows past the end;
    its pages padded by about 1/32 of a slot for a padded ``pool_layout`` (vLLM's: 135168 elements a page for
    a 131072-element state), and the output slice 1 to 7 rows into the caller's buffer (seeded)."""
    owners = case.num_seqs + len(case.checkpoints)
    num_slots = 1 + owners + spare_slots
    gen = torch.Generator().manual_seed(case.seed + 1)
    order = (torch.randperm(num_slots - 1, generator=gen) + 1).tolist()
    slot = case.num_v_heads * case.head_k_dim * case.head_v_dim
    return PoolPlan(
        num_slots=num_slots,
        seq_slots=tuple(order[: case.num_seqs]),
        checkpoint_slots=tuple(order[case.num_seqs : owners]),
        padding=padding,
        out_rows=case.total_tokens + tail_rows,
        slot_padding=0 if case.pool_layout == "dense" else max(64, slot // 32) + 16 * (case.seed % 4),
        out_offset=1 + case.seed % 7,
        out_after=3,
    )


def outside(x: torch.Tensor) -> torch.Tensor:
    """A mask over ``memory_of(x)``: True where an element is not one of ``x``'s (memory it does not own)."""
    covered = torch.zeros(memory_of(x).numel(), dtype=torch.bool, device=x.device)
    covered.as_strided(x.shape, x.stride(), x.storage_offset()).fill_(True)
    return ~covered


def pool_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, slot_padding: int) -> torch.Tensor:
    """A pool ``[slots, ...]`` of zeros whose slots lie ``slot_padding`` elements apart past one slot: a view of a
    larger buffer, as a server's allocator pages it (a dense tensor where the padding is 0)."""
    if not slot_padding:
        return torch.zeros(shape, dtype=dtype, device=device)
    slot = math.prod(shape[1:])
    memory = torch.zeros(shape[0] * (slot + slot_padding), dtype=dtype, device=device)
    inner = torch.empty(shape[1:], device="meta").stride()
    return torch.as_strided(memory, shape, (slot + slot_padding, *inner))


def pad_slot_for(backend: Backend, case: Case) -> int:
    """The sentinel ``case``'s padding entries carry for ``backend``: one of those it declares, by the case's
    seed, so a run and its repro hand the same one."""
    declared = backend.pad_slot_ids
    bad = [s for s in declared if s not in PAD_SLOT_IDS]
    if not declared or bad:
        raise ValueError(
            f"backend {backend.name!r} declares pad_slot_ids {declared!r}; allowed: a non-empty tuple of "
            f"{', '.join(map(str, PAD_SLOT_IDS))}"
        )
    return declared[case.seed % len(declared)]


def check_slots(state_indices: torch.Tensor, num_slots: int, num_seqs: int) -> None:
    """Refuse indices a pool cannot honour: out of range, the null slot, or one slot named twice."""
    real = state_indices[:num_seqs].tolist()
    bad = [s for s in real if not 0 < s < num_slots]
    if bad:
        raise ValueError(
            f"state_indices {bad} out of range: a sequence's slot must be in 1..{num_slots - 1} "
            f"(slot {NULL_SLOT} is the null block; {PAD_SLOT_ID} and {NULL_SLOT} mark padding entries only)"
        )
    if len(set(real)) != len(real):
        twice = sorted({s for s in real if real.count(s) > 1})
        raise ValueError(
            f"state_indices name slot(s) {twice} for more than one sequence: two requests would share one "
            "recurrent state, and the order of their writes decides which survives; give each its own slot"
        )
    rest = state_indices[num_seqs:].tolist()
    if any(s not in PAD_SLOT_IDS for s in rest):
        allowed = " or ".join(map(str, PAD_SLOT_IDS))
        raise ValueError(f"state_indices past the {num_seqs} sequences must be {allowed} (padding), got {rest}")


def poison_like(x: torch.Tensor, mode: str, seed: int = 0) -> torch.Tensor:
    """A tensor shaped like ``x`` filled per ``mode`` (``tenant``: a plausible state of another request)."""
    if mode not in POISON_MODES:
        raise ValueError(f"poison mode {mode!r} unknown; choose from {', '.join(POISON_MODES)}")
    if mode == "none":
        return torch.zeros_like(x)
    if mode == "nan":
        # A NaN with its own payload: bitwise unlike the canonical NaN torch.empty is filled with under the
        # fill-uninitialized-memory mode, so scratch copied over a poisoned row still shows as a write.
        pattern = {torch.bfloat16: 0x7FC1, torch.float16: 0x7E01, torch.float32: 0x7FC00001}.get(x.dtype)
        if pattern is None:
            return torch.full_like(x, float("nan"))
        return torch.full(x.shape, pattern, dtype=INT_OF_SIZE[x.element_size()], device=x.device).view(x.dtype)
    if mode == "inf":
        signs = torch.ones(x.numel(), dtype=torch.float32)
        signs[1::2] = -1
        return (signs * float("inf")).reshape(x.shape).to(x.dtype).to(x.device)
    if mode == "sentinel":
        return torch.full_like(x, SENTINEL if x.dtype != torch.float16 else 6e4)
    gen = torch.Generator().manual_seed(seed + 104729)
    if mode == "garbage":  # random bit patterns: any value, NaN and Inf included
        bits = torch.randint(-(2**15), 2**15, (x.numel() * x.element_size() // 2,), generator=gen, dtype=torch.int16)
        return bits.view(x.dtype).reshape(x.shape).to(x.device)
    return torch.randn(x.shape, generator=gen).mul_(0.5).to(x.dtype).to(x.device)  # tenant


@dataclass
class ServingRun:
    """One batch through the harness: the pool and buffer before and after, and what the case defines."""

    plan: PoolPlan
    inputs: KDAInputs  # packed, one row; ``initial_state`` is what the pool held for resumed sequences
    pool_before: torch.Tensor
    pool: torch.Tensor
    out_before: torch.Tensor
    out: torch.Tensor
    # The whole memory the pool and the output slice are views into, as it was before the batch.
    pool_memory_before: torch.Tensor | None = None
    out_memory_before: torch.Tensor | None = None

    @property
    def o(self) -> torch.Tensor:
        return self.out[:, : self.inputs.case.total_tokens]

    @property
    def final_states(self) -> torch.Tensor:
        return self.pool[list(self.plan.seq_slots)]

    @property
    def checkpoint_states(self) -> torch.Tensor | None:
        return self.pool[list(self.plan.checkpoint_slots)] if self.plan.checkpoint_slots else None


def build_pool(inputs: KDAInputs, plan: PoolPlan, poison: str, regions: tuple[str, ...] | None = None) -> torch.Tensor:
    """The pool before the batch: resumed sequences' slots hold their initial states; every other slot
    (slot 0, fresh sequences', checkpoints', spare) holds ``poison``. ``regions`` limits the poison to some
    of ``null``, ``fresh``, ``checkpoint``, ``spare`` (for localizing which one a backend reads)."""
    case = inputs.case
    HV, K, V = case.num_v_heads, case.head_k_dim, case.head_v_dim
    shape = (plan.num_slots, HV, V, K) if case.state_v_first else (plan.num_slots, HV, K, V)
    dtype = stored_dtype(case, "final_state")
    pool = pool_tensor(shape, dtype, inputs.device, plan.slot_padding)
    if plan.slot_padding:  # the gaps between slots: memory the kernel must neither read nor write
        memory = memory_of(pool)
        memory.copy_(poison_like(memory, poison, case.seed + 2))
        pool.zero_()
    filled = poison_like(pool, poison, case.seed)
    fresh = [] if case.has_initial_state else list(plan.seq_slots)
    spare = [s for s in plan.unnamed_slots if s != NULL_SLOT]
    areas = {"null": [NULL_SLOT], "fresh": fresh, "checkpoint": list(plan.checkpoint_slots), "spare": spare}
    for region, slots in areas.items():
        if slots and (regions is None or region in regions):
            pool[slots] = filled[slots]
    if case.has_initial_state:
        pool[list(plan.seq_slots)] = inputs.initial_state.to(dtype)
    return pool


def new_out(case: Case, plan: PoolPlan, poison: str, device: torch.device) -> torch.Tensor:
    """The caller's output slice ``[1, out_rows, HV, V]``, ``poison`` in every row: ``out_offset`` rows into a
    larger buffer whose rows before and after it (poisoned too) belong to someone else."""
    rows = plan.out_offset + plan.out_rows + plan.out_after
    whole = torch.zeros((1, rows, case.num_v_heads, case.head_v_dim), dtype=stored_dtype(case, "o"))
    whole = poison_like(whole, poison, case.seed + 1).to(device)
    return whole[:, plan.out_offset : plan.out_offset + plan.out_rows]


def serve(
    backend: Backend,
    inputs: KDAInputs,
    pool: torch.Tensor,
    seq_slots: tuple[int, ...],
    has_initial_state: tuple[bool, ...],
    out: torch.Tensor,
    checkpoint_slots: tuple[int, ...] = (),
    padding: int = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> None:
    """One batch, in place on ``pool`` and ``out``: the sequences of the packed ``inputs`` (their
    ``initial_state`` is ignored: resumed sequences read their slot), ``padding`` padding entries after them
    (their sentinel: ``pad_slot_for``). ``cu_seqlens``: a tensor object to reuse, given the batch's offsets as
    new contents."""
    case, device = inputs.case, inputs.device
    offsets = cu_seqlens_tensor(case, device, padding)
    if cu_seqlens is not None:
        cu_seqlens.copy_(offsets)  # same object, new contents: a kernel caching on its identity gets stale bounds
        offsets = cu_seqlens
    pad = pad_slot_for(backend, case)
    indices = torch.tensor((*seq_slots, *(pad,) * padding), dtype=torch.int32, device=device)
    has_initial = torch.tensor((*has_initial_state, *(False,) * padding), dtype=torch.bool, device=device)
    checkpoints = torch.tensor(checkpoint_slots, dtype=torch.int32, device=device)
    batch = dataclasses.replace(inputs, initial_state=None, cu_seqlens=offsets)
    with torch.inference_mode():
        if backend.run_paged is not None:
            run_paged_call(backend, batch, pool, indices, has_initial, out, checkpoints)
        else:
            gather_run_scatter(backend, batch, pool, indices, has_initial, out, checkpoints)


def run_serving(
    backend: Backend,
    inputs: KDAInputs,
    plan: PoolPlan,
    poison: str = "none",
    regions: tuple[str, ...] | None = None,
) -> ServingRun:
    """One batch as planned: build the pool and the caller's output buffer (``poison`` in every byte the
    backend must not use; ``regions`` limits it, ``tail`` naming the output rows past the tokens), serve."""
    case = inputs.case
    pool = build_pool(inputs, plan, poison, regions)
    out = new_out(case, plan, poison if regions is None or "tail" in regions else "none", inputs.device)
    pool_before, out_before = pool.clone(), out.clone()
    memories = memory_of(pool).clone(), memory_of(out).clone()
    serve(
        backend,
        inputs,
        pool,
        plan.seq_slots,
        (case.has_initial_state,) * case.num_seqs,
        out,
        plan.checkpoint_slots,
        plan.padding,
    )
    return ServingRun(plan, inputs, pool_before, pool, out_before, out, *memories)


def gather_run_scatter(
    backend: Backend,
    batch: KDAInputs,
    pool: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    out: torch.Tensor,
    checkpoint_slots: torch.Tensor,
) -> None:
    """The paged call for a backend without one, as vLLM's Triton path does it: fresh sequences start
    from zeros (their slot is never read), padding entries are dropped, states are scattered by slot."""
    case = batch.case
    n = case.num_seqs
    check_slots(state_indices, pool.shape[0], n)
    slots = state_indices[:n].long()
    resumed = has_initial_state[:n]
    h0 = None
    if bool(resumed.any()):
        h0 = torch.where(resumed.view(-1, 1, 1, 1), pool[slots], torch.zeros_like(pool[slots]))
    cu = batch.cu_seqlens
    if cu.numel() != n + 1:  # padding entries to drop; else the caller's tensor object itself, untouched
        cu = cu[: n + 1]
    result = run_backend_call(backend, dataclasses.replace(batch, initial_state=h0, cu_seqlens=cu))
    _fits_the_pool(backend, result, out, pool, n, len(checkpoint_slots), case.total_tokens)
    T = case.total_tokens
    out[:, :T] = result.o[:, :T]  # token tensors padded past the sequences give output rows no one owns
    pool[slots] = result.final_state.to(pool.dtype)
    if len(checkpoint_slots):
        pool[checkpoint_slots.long()] = result.checkpoint_states.to(pool.dtype)


def _fits_the_pool(
    backend: Backend, result: BackendOutput, out: torch.Tensor, pool: torch.Tensor, n: int, checkpoints: int, T: int
) -> None:
    """A result the harness can copy into the caller's buffer and scatter into the pool; otherwise the
    backend's fault, said in the pool's terms (not a shape error of the harness's own code)."""
    state = pool.shape[1:]
    wanted = {
        "o": (result.o, (out.shape[0], T, *out.shape[2:]), True),
        "final_state": (result.final_state, (n, *state), True),
        "checkpoint_states": (result.checkpoint_states, (checkpoints, *state), checkpoints > 0),
    }
    for name, (tensor, shape, needed) in wanted.items():
        if not needed:
            continue
        if tensor is None:
            raise fault(backend, f"returned no {name}; the batch needs {list(shape)}")
        o_fits = tensor.dim() == 4 and tensor.shape[1] >= T and tensor.shape[2:] == out.shape[2:]
        if (name == "o" and not o_fits) or (name != "o" and tuple(tensor.shape) != shape):
            raise fault(backend, f"returned {name} of shape {list(tensor.shape)}; the batch needs {list(shape)}")


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
