"""The night's guaranteed cases: a few cases that together reach every value of ``NIGHT_REQUIRED``
(cases/coverage.py), whatever the seed.

Which axis values a night of drawn cases reaches depends on its seed (one night drew only lower-bound gates
and 3 fp32 cases), and some production shapes were never drawn at all (an explicit scale, K = V = 128 in
fp32). These cases fix what must be reached and let the seed vary the rest. Their kernel configurations
(the fields a backend compiles a kernel for: heads, head dims, dtypes, gate form and bound, in-kernel flags,
layout, packing, an initial state or none) are fixed, ``CONFIGS`` below, the same every night: a cold
machine compiles and tunes the same kernels night after night, which the H200's recorded autotune choices
(kernels/autotune/) and a host's Triton cache then hold. The K = V = 128 ones are sentinels'
configurations (cases/sentinels.json), so they add no compile. The seed draws everything else: the
lengths (each required length edge dealt over the cases in a shuffled cycle), the checkpoints, the
scale's presence and value, the regimes, the initial state's kind, the batch size and the inputs. They run
on every backend (conformance/test_corpus.py), and their kernel configurations are the pool the night's
drawn cases take theirs from (cases/strategies.with_kernel_pool), so they add no compile either.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, TypeVar

from kda_cases.case import (
    BETA_REGIMES,
    GATE_REGIMES,
    INITIAL_STATES,
    INPUT_LAYOUTS,
    INPUT_SCALES,
    KEY_REGIMES,
    POOL_LAYOUTS,
    ZERO_TOKENS,
    Case,
)
from kda_cases.coverage import CHUNK

T = TypeVar("T")

# One kernel configuration per case, and the packing it is served with ("one", "batch": a [B, T] batch with
# an initial state, "packed": packed with a zero-length member). Together they reach every required value
# of a kernel axis: the three K = V = 128 dtypes, K and V of 32, 64, 128 and 256 (and 100, 60, 192), every
# gate form, both state dtypes and layouts, every head count class (1, 2-7, >= 8, GVA), and both values of
# each in-kernel flag. The K = V = 128 ones are sentinels' 4-query / 8-value-head configurations (the three
# dtypes on one sequence, fp16 with an initial state), so they add no compile.
CONFIGS: tuple[dict[str, Any], ...] = (
    dict(head_k_dim=128, head_v_dim=128, dtype="bf16", num_heads=4, num_v_heads=8, packing="one", h0=False),
    dict(head_k_dim=128, head_v_dim=128, dtype="fp16", num_heads=4, num_v_heads=8, packing="one", h0=False),
    dict(head_k_dim=128, head_v_dim=128, dtype="fp32", num_heads=4, num_v_heads=8, packing="one", h0=False),
    dict(head_k_dim=128, head_v_dim=128, dtype="fp16", num_heads=4, num_v_heads=8, packing="batch"),
    dict(head_k_dim=32, head_v_dim=64, dtype="bf16", num_heads=1, num_v_heads=1, packing="one", h0=True,
         gate="softplus", lower_bound=None, safe_gate=False, state_dtype="bf16", state_layout="v_first",
         l2norm_in_kernel=False),
    dict(head_k_dim=64, head_v_dim=32, dtype="fp32", num_heads=6, num_v_heads=6, packing="packed",
         gate="log", lower_bound=-1.0, state_layout="v_first", beta_sigmoid_in_kernel=False),
    dict(head_k_dim=256, head_v_dim=256, dtype="fp16", num_heads=8, num_v_heads=8, packing="one", h0=False,
         lower_bound=-0.01, state_dtype="bf16", l2norm_in_kernel=False),
    # Head dims that are not powers of two (FLA's own tests draw 60 and 100; FLA #1134 read g out of bounds for
    # them), with a tensor-parallel rank's head count (48 heads over 8 ranks: 6 value heads in groups of 3).
    # g and beta in float32 beside bf16 tokens, as vLLM's Kimi Linear layer passes them to chunk_kda.
    dict(head_k_dim=100, head_v_dim=60, dtype="bf16", num_heads=2, num_v_heads=6, packing="packed", h0=True,
         gate_dtype="fp32"),
    # K = 192, the last of the state kernel's 64-wide key tiles (FLA chunk_delta_h.py: K > 192 opens a fourth),
    # with 24 value heads in groups of 3 (96 heads over tensor-parallel 4): past 16, the most value heads a
    # drawn case of the nightly has.
    dict(head_k_dim=192, head_v_dim=128, dtype="bf16", num_heads=8, num_v_heads=24, packing="one", h0=True),
    # 20 value heads in groups of 4 (5 query heads): past a multiple of 8 or 16 by 4, the remainder a kernel that
    # tiles heads by 8 or 16 leaves (6 and 24 leave 2 and 8); a packed batch from states.
    dict(head_k_dim=64, head_v_dim=64, dtype="bf16", num_heads=5, num_v_heads=20, packing="packed", h0=True),
    # 12 heads, a rank's share of 48 over tensor-parallel 4 (96 over 8), ungrouped and at K = V = 128 in bf16, so
    # that FlashKDA's kernels (no grouped value heads) get a head count past a tile of 8 too; from states.
    dict(head_k_dim=128, head_v_dim=128, dtype="bf16", num_heads=12, num_v_heads=12, packing="packed", h0=True),
)  # fmt: skip
EDGES = ("64m - 1", "64m", "64m + 1", "2047", "2048", "2049")
# A server-sized batch on the packed configuration above (so no compile of its own): 48 to 64 requests,
# most a few tokens, some empty, a few long, each resuming a state: a few hundred (sequence, head) programs.
SERVER_BATCH = CONFIGS[5]
SERVER_SEQS = (48, 64)


def _dealt(rng: random.Random, values: tuple[T, ...], count: int) -> list[T]:
    """``values`` dealt over ``count`` cases: each value at least once (count >= len(values)), in a shuffled
    order, the remaining cases drawn."""
    dealt = list(values) + [rng.choice(values) for _ in range(count - len(values))]
    rng.shuffle(dealt)
    return dealt


def _length(rng: random.Random, edge: str) -> int:
    if edge in EDGES[3:]:
        return int(edge)
    m = rng.randint(2, 8)
    return CHUNK * m + {"64m - 1": -1, "64m": 0, "64m + 1": 1}[edge]


def _rho(rho: float, magnitude: str) -> float:
    """Identical keys (rho 1) only with typical magnitudes, as cases/strategies.py draws them."""
    return 0.99 if rho == 1.0 and magnitude != "typical" else rho


def guaranteed_cases(seed: int | None) -> list[Case]:
    """The night's guaranteed cases for ``seed`` (the same cases for the same seed; the same kernel
    configurations for every seed)."""
    rng = random.Random(seed)
    count = len(CONFIGS)
    scales = _dealt(rng, (False, True), count)
    edges = _dealt(rng, EDGES, count)
    checkpoints = _dealt(rng, ("on", "off", "none"), count)
    # From a generator of its own: the draws above and below, and so each seed's cases, are as before.
    layouts = _dealt(random.Random(f"input_layout {seed}"), INPUT_LAYOUTS, count)
    magnitudes = _dealt(random.Random(f"input_scale {seed}"), INPUT_SCALES, count)
    pools = _dealt(random.Random(f"pool_layout {seed}"), POOL_LAYOUTS, count)
    zeros = _dealt(random.Random(f"zero_tokens {seed}"), ZERO_TOKENS, count)
    cases = []
    for i, config in enumerate(CONFIGS):
        fields = {k: v for k, v in config.items() if k not in ("packing", "h0")}
        packing = config["packing"]
        length = _length(rng, edges[i])
        with_h0 = config.get("h0", packing != "one")  # a batch, and a packed one, start from a state
        initial_state = rng.choice(INITIAL_STATES[1:]) if with_h0 else "none"
        seq_lens: tuple[int, ...]
        if packing == "one":
            seq_lens, packed = (length,), False
        elif packing == "batch":
            seq_lens, packed = (length,) * rng.randint(2, 3), False
        else:
            seq_lens, packed = (length, 0, rng.randint(1, 2 * CHUNK)), True
        marks: tuple[tuple[int, int], ...] = ()
        if checkpoints[i] == "on":
            marks = ((0, CHUNK * rng.randint(1, length // CHUNK)),)
        elif checkpoints[i] == "off":
            marks = ((0, CHUNK * rng.randint(0, length // CHUNK - 1) + rng.randint(1, CHUNK - 1)),)
        key_regime = rng.choice(KEY_REGIMES)
        cases.append(
            Case(
                seq_lens=seq_lens,
                packed=packed,
                **fields,
                gate_regime=rng.choice(GATE_REGIMES),
                key_regime=key_regime,
                key_rho=_rho(rng.choice((0.9, 0.99, 1.0)), magnitudes[i]) if key_regime == "correlated" else 0.0,
                beta_regime=rng.choice(BETA_REGIMES),
                initial_state=initial_state,
                checkpoints=marks,
                input_layout=layouts[i],
                input_scale=magnitudes[i],
                pool_layout=pools[i],
                zero_tokens=zeros[i],
                scale=rng.choice((0.5, 1.0, 2.0)) / config["head_k_dim"] ** 0.5 if scales[i] else None,
                seed=rng.randrange(2**31),
                tags=("guaranteed",),
            )
        )
    return [*cases, _server_batch(seed)]


def _server_batch(seed: int | None) -> Case:
    """The night's server-sized batch, from a generator of its own (the cases above stay as they were)."""
    rng = random.Random(f"server batch {seed}")
    fields = {k: v for k, v in SERVER_BATCH.items() if k not in ("packing", "h0")}
    kinds = rng.choices(("short", "empty", "long"), weights=(12, 2, 1), k=rng.randint(*SERVER_SEQS))
    length: dict[str, Callable[[], int]] = {
        "short": lambda: rng.randint(1, 2 * CHUNK),
        "empty": lambda: 0,
        "long": lambda: rng.randint(1000, 8192),
    }
    seq_lens = tuple(length[kind]() for kind in kinds)
    # Decodes chunked with the prefills (vLLM's GLM-5.3-Flash and Kimi K3 paths): 2 to 6 requests of one token
    # each, placed from a generator of their own, so the rest of each seed's batch is as it was.
    decodes = random.Random(f"server batch decodes {seed}")
    short = [i for i, kind in enumerate(kinds) if kind == "short"]
    for i in decodes.sample(short, min(len(short), decodes.randint(2, 6))):
        seq_lens = (*seq_lens[:i], 1, *seq_lens[i + 1 :])
    key_regime = rng.choice(KEY_REGIMES[:2])
    return Case(
        seq_lens=seq_lens,
        packed=True,
        **fields,
        gate_regime=rng.choice(GATE_REGIMES),
        key_regime=key_regime,
        key_rho=0.9 if key_regime == "correlated" else 0.0,
        beta_regime=rng.choice(BETA_REGIMES),
        initial_state=rng.choice(INITIAL_STATES[1:]),
        input_layout=rng.choice(INPUT_LAYOUTS),
        input_scale=rng.choice(INPUT_SCALES),
        pool_layout="padded",  # a server batch's pool, as vLLM's hybrid allocator pages it
        seed=rng.randrange(2**31),
        tags=("guaranteed", "server batch"),
    )
