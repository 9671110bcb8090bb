"""Named sweep profiles: how many cases, how large, how they are searched.

``smoke`` takes seconds, ``ci`` is the CPU tier (minutes, derandomized, so CI
runs the same cases every time), ``cpu-nightly`` the nightly's search at CPU sizes,
``nightly`` is the GPU sweep (a few cases per
property from a few kernel configurations, up to 128K tokens x 16 heads, the
corpus' 128K case for every backend, a fresh seed each night, searching toward the worst
error/budget), ``long`` only 32K tokens and more. Pytest selects one with
``--kda-profile``, the CLI with ``kda-conformance run --profile``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kda_cases.case import DTYPES, Case

# Lengths on and around the kernels' boundaries: sub-chunks (16), chunks (32, 64), FlashKDA's
# segments (2048 = 64 chunks of 32), and long contexts up to 128K.
BOUNDARY_LENGTHS = (1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 2016, 2047, 2048, 2049, 8191, 8192, 8193, 32768, 131072)


@dataclass(frozen=True)
class Profile:
    name: str
    max_examples: int  # per property and backend
    max_total_tokens: int  # per case; corpus cases above it are skipped with that reason
    min_length: int  # the longest sequence of a drawn case is at least this
    max_seqs: int
    max_heads: int
    head_dims: tuple[int, ...]
    dtypes: tuple[str, ...]
    derandomize: bool  # the same cases on every run (CI); otherwise a seed per run, recorded
    targeted: bool  # steer the search toward large error/budget ratios (hypothesis.target)
    # Only gates with a lower bound (safe_gate), for backends that run interpreted (``for_backend``): FLA's
    # other gate path takes 40 to 60 s per call for 100 tokens in Triton's interpreter against about 1 s for
    # the safe gate. Backends that run compiled (or in plain PyTorch) draw every gate form.
    safe_gates_only: bool = False
    # Server-sized batches: packed (or [B, T]) batches of 9 to this many sequences, most short, some empty,
    # some long, drawn for a part of the cases (0: none): per-sequence tables, grid bounds and index
    # arithmetic that break past a few hundred (sequence, head) programs. Not for interpreted backends in
    # the CPU tiers (``for_backend``).
    server_batch_seqs: int = 0
    # Corpus cases longer than this are skipped for interpreted backends, with that reason (the CPU tiers
    # cannot afford 2K tokens through FLA's interpreted kernels: 2 minutes for the recurrent kernel alone).
    corpus_max_tokens: int = 2**40
    # Corpus cases with more work than this (tokens x value heads x K x V) are skipped for every backend:
    # on the CPU the float64 reference and the baseline take 5 s and 4 s for 2048 tokens x 8 heads x 128^2.
    corpus_max_work: int = 2**60
    # Drawn cases with more work than this (tokens x value heads x K x V) draw shorter sequences: the GPU
    # tiers stop at the scale, 128K tokens x 16 heads x 128 x 128, where the float64 truth takes
    # 0.22 s on an H200 but drawing the inputs on the CPU takes seconds (docs/reference-speed.md).
    max_work: int = 2**60
    # How many kernel configurations (heads, head dims, dtypes, gate form, in-kernel flags, state layout,
    # packing, initial state or none) one run draws its cases from; 0: every case draws its own. Each
    # configuration is a Triton compile and autotune of every chunk kernel (70 to 90 s on a fresh H200),
    # so a night affords a few; the seed picks them, so the nights together cover the axes.
    kernel_configs: int = 0
    kernel_pool: tuple[tuple[tuple[str, object], ...], ...] = ()  # filled per run: see strategies.with_kernel_pool
    # The dtypes of the run's long cases (``long_tokens`` tokens each, drawn from the run's seed and run on
    # every backend by conformance/test_corpus.py::test_long_case): a night reaches 128K tokens in every
    # dtype, whatever Hypothesis draws.
    long_dtypes: tuple[str, ...] = ()
    long_tokens: int = 131072
    # The dtypes of the run's long backward cases (``long_backward_tokens`` tokens each, two packed halves with
    # initial states, drawn from the run's seed; conformance/test_corpus.py::test_long_backward runs the
    # gradients check on each with every backend that declares a backward): the lengths a training step takes,
    # whatever Hypothesis draws.
    long_backward_dtypes: tuple[str, ...] = ()
    long_backward_tokens: int = 32768
    # Value heads, up to this (0: ``max_heads``): grouped value heads (GVA) with two query heads or more, where
    # a wrong value-to-query head mapping shows (with one query head it changes nothing).
    max_v_heads: int = 0
    # Whether the run includes the sentinels (cases/sentinels.py): the same 41 cases every night, each with
    # a history of its own. Up to 128K tokens x 8 value heads x 128^2: the GPU profiles only.
    sentinels: bool = False
    # Whether the run includes the guaranteed cases (cases/guarantee.py), whose kernel configurations are then
    # the pool its drawn cases take theirs from: the night reaches every value of NIGHT_REQUIRED, whatever
    # the seed.
    guaranteed: bool = False
    # At most this many distinct kernel configurations in one run's planned cases (the guaranteed and drawn
    # ones, the corpus, the sentinels, the long cases): each is a compile and autotune per Triton backend.
    max_kernel_configs: int = 2**31

    @property
    def value_heads_limit(self) -> int:
        return self.max_v_heads or self.max_heads

    def for_backend(self, interpreted: bool) -> Profile:
        """The profile a backend's cases are drawn from. Safe gates only and small batches are the CPU tiers'
        price of Triton's interpreter (seconds per program: a server batch of 40 sequences and 4 heads
        launches 160), so an interpreted backend of those tiers draws without server batches, and a backend
        that does not run interpreted draws every gate form."""
        if interpreted:
            return dataclasses.replace(self, server_batch_seqs=0) if self.safe_gates_only else self
        return dataclasses.replace(self, safe_gates_only=False) if self.safe_gates_only else self

    def corpus_skip(self, case: Case, interpreted: bool) -> str | None:
        """Why a corpus case does not run in this profile (None when it runs)."""
        work = case.total_tokens * case.num_v_heads * case.head_k_dim * case.head_v_dim
        if work > self.corpus_max_work:
            return (
                f"{case.total_tokens} tokens x {case.num_v_heads} heads x {case.head_k_dim}x{case.head_v_dim} exceed "
                f"the {self.name} profile's corpus work limit (it runs in the nightly and long profiles)"
            )
        if interpreted and case.total_tokens > self.corpus_max_tokens:
            return (
                f"{case.total_tokens} tokens exceed the {self.name} profile's corpus limit of "
                f"{self.corpus_max_tokens} for interpreted backends (it runs in the nightly and long profiles)"
            )
        return None


PROFILES: dict[str, Profile] = {
    profile.name: profile
    for profile in (
        # The CPU tiers run FLA in Triton's interpreter (seconds per call): small cases, few of them.
        Profile(
            "smoke",
            2,
            64,
            1,
            2,
            2,
            (32,),
            ("bf16",),
            True,
            False,
            safe_gates_only=True,
            corpus_max_tokens=64,
            corpus_max_work=2**22,
        ),
        Profile(
            "ci",
            3,
            96,
            1,
            3,
            2,
            (32, 32, 60),
            DTYPES,
            True,
            False,
            safe_gates_only=True,
            corpus_max_tokens=256,
            corpus_max_work=2**23,
            max_v_heads=6,  # 6: two query heads in groups of 3, a rank's share of 48 heads over tensor-parallel 8
            server_batch_seqs=64,  # with 3 value heads or more, 129 (sequence, head) pairs and up, in 96 tokens
        ),
        # The nightly's search on a CPU: a fresh seed, steered toward the worst error/limit, server batches,
        # head sizes past the CI tier's, at sizes the CPU computes in minutes (no 128K cases, no sentinels).
        # The correct controls are held to passing it (tests/test_correct_variants.py).
        Profile(
            "cpu-nightly",
            12,
            1024,
            1,
            6,
            4,
            (32, 64),
            DTYPES,
            False,
            True,
            corpus_max_tokens=256,
            corpus_max_work=2**23,
            max_work=2**23,
            server_batch_seqs=64,
            max_v_heads=8,
        ),
        # 12 examples per check and backend: with five backends, 500 drawn cases and more a night.
        Profile(
            "nightly",
            12,
            2 * 131072,
            1,
            6,
            16,
            (64, 128),
            DTYPES,
            False,
            True,
            # 2^33 (was 2^35): a shard of the night on a warm H200 spent 639 s of its workers drawing inputs
            # on their one CPU thread each, and its tests of 11 to 20 such cases ran past 190 s each; 128K
            # tokens stay reached by the long cases, the corpus and the sentinels (up to 2^34 each).
            max_work=2**33,
            server_batch_seqs=64,
            kernel_configs=11,  # the guaranteed cases' configurations (cases/guarantee.py CONFIGS)
            long_dtypes=("bf16", "fp16", "fp32", "bf16"),
            long_backward_dtypes=("bf16",),
            sentinels=True,
            guaranteed=True,
            # 39, new each night, until the guaranteed, long and sentinel cases were re-pinned; 25 with the
            # guaranteed configuration of head dims 100 and 60, 26 with K = 192 and 12 value heads (24 since), 27
            # with 20 value heads, 28 with 12 value heads again (ungrouped, K = V = 128)
            max_kernel_configs=28,
        ),
        Profile(
            "long",
            4,
            2 * 131072,
            32768,
            2,
            16,
            (128,),
            DTYPES,
            False,
            True,
            max_work=2**35,
            kernel_configs=2,
            long_dtypes=DTYPES,
            long_backward_dtypes=("bf16", "fp32"),
            sentinels=True,
        ),
    )
}


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"profile {name!r} is not defined; choose from {', '.join(PROFILES)}")
    return PROFILES[name]
