"""Kernel configurations: the axes of a case that select which compiled kernels a backend runs.

Two cases of one configuration differ only in lengths, seeds and regimes, so a Triton backend compiles and
autotunes once for both (70 to 170 s on a fresh H200 for FLA's chunk path), and a configuration that crashed
the device once will crash it again. The night counts them, compiles them up front
(conformance/running/compile.py) and quarantines a configuration after a sticky device error
(reports/quarantine.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from kda_cases.case import Case
from kda_cases.coverage import CHUNK

# The Case fields a kernel is specialised on (constexprs, autotune keys, in-kernel flags, layouts, packing).
KERNEL_FIELDS = (
    "num_heads",
    "num_v_heads",
    "head_k_dim",
    "head_v_dim",
    "dtype",
    "gate_dtype",
    "state_dtype",
    "gate",
    "lower_bound",
    "safe_gate",
    "l2norm_in_kernel",
    "beta_sigmoid_in_kernel",
    "state_layout",
    "packed",
)

KernelConfig = tuple[tuple[str, object], ...]


def kernel_config(case: Case) -> KernelConfig:
    """The kernel configuration of ``case``: its KERNEL_FIELDS and whether it has an initial state."""
    return (*((name, getattr(case, name)) for name in KERNEL_FIELDS), ("has_initial_state", case.has_initial_state))


def config_label(config: KernelConfig) -> str:
    """A short, stable text for a configuration (a quarantine's key, a compile job's name)."""
    values = dict(config)
    gate = values["gate"] if values["lower_bound"] is None else f"{values['gate']}{values['lower_bound']:g}"
    flags = "".join(
        flag
        for flag, on in (
            ("+l2", values["l2norm_in_kernel"]),
            ("+sig", values["beta_sigmoid_in_kernel"]),
            ("+safe", values["safe_gate"]),
            ("+varlen", values["packed"]),
            ("+h0", values["has_initial_state"]),
        )
        if on
    )
    return (
        f"H{values['num_heads']}/{values['num_v_heads']} K{values['head_k_dim']} V{values['head_v_dim']} "
        f"{values['dtype']} state-{values['state_dtype']} {values['state_layout']} {gate}{flags}"
    )


def distinct_configs(cases: Iterable[Case]) -> dict[KernelConfig, Case]:
    """Each distinct configuration of ``cases`` with the first case that has it, in order."""
    found: dict[KernelConfig, Case] = {}
    for case in cases:
        found.setdefault(kernel_config(case), case)
    return found


# Some kernels choose code paths and constexprs by the size of a call, not only by its configuration: SGLang
# 0.5.23's chunk_kda fuses its diagonal blocks into one kernel for grids of at most 256 programs (sequences x
# chunks x heads) and buckets its state kernel by the chunk count (<= 32, <= 128, more: a constexpr in its
# autotune key). A 70-token warm-up compiles the first of each only, and a 128K-token fp32 case then compiled
# and tuned its own kernels in the middle of a night's shard on a cold H200 (one call of 184 s).
CHUNK_BUCKETS = (32, 128)  # the chunk counts where a bucket ends
SMALL_GRID = 256  # programs
SizeClass = tuple[int, bool]  # (chunk bucket, a grid of more than SMALL_GRID programs)
SMALLEST: SizeClass = (0, False)
MOST_CHUNKS = CHUNK_BUCKETS[-1] + 2 + SMALL_GRID  # past every edge


def _chunks(lens: Iterable[int]) -> int:
    return sum(-(-n // CHUNK) for n in lens)


def _size_class(case: Case, lens: tuple[int, ...]) -> SizeClass:
    # Packed: one row of every sequence's chunks; a [B, T] batch: B rows of T's chunks.
    chunks, rows = (_chunks(lens), 1) if case.packed else (_chunks(lens[:1]), len(lens))
    bucket = sum(chunks > edge for edge in CHUNK_BUCKETS)
    return bucket, rows * chunks * case.num_heads > SMALL_GRID


def size_class(case: Case) -> SizeClass:
    """The size class of ``case``: which chunk-count bucket its call falls in and whether its grid is large
    (the size-chosen paths above), so that a warm-up of each class a night meets compiles what it runs."""
    return _size_class(case, case.seq_lens)


def size_label(size: SizeClass) -> str:
    """Words for a size class other than the smallest (which needs none)."""
    if size == SMALLEST:
        return ""
    bucket, large = size
    chunks = f"{CHUNK_BUCKETS[bucket - 1] + 1}+ chunks" if bucket else f"<= {CHUNK_BUCKETS[0]} chunks"
    return f"{chunks}{f', grid > {SMALL_GRID}' if large else ''}"


def warm_up_case(case: Case) -> Case:
    """A short case of ``case``'s configuration and size class (the same heads, dims, flags, layout, packing
    and initial state; a few chunks, or the fewest that reach its class): what the compile stage runs to
    build and tune its kernels before the night's cases."""
    want = size_class(case)
    if case.packed:
        tail = (0, 33) if len(case.seq_lens) > 1 else ()
        shapes = ((CHUNK * (c - 1) + 6, *tail) for c in range(2, MOST_CHUNKS))
    else:
        rows = min(2, len(case.seq_lens)) if want == SMALLEST else len(case.seq_lens)
        shapes = ((CHUNK * (c - 1) + 6,) * rows for c in range(2, MOST_CHUNKS))
    # A sequence of c chunks (one partial): the first of the class; the case's own lengths where none is
    # (a class that these shapes cannot reach).
    lens = next((lens for lens in shapes if _size_class(case, lens) == want), case.seq_lens)
    return case.replace(seq_lens=lens, checkpoints=(), tags=("compile",))
