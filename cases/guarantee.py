"""The night's guaranteed cases: a few cases that together reach every value of ``NIGHT_REQUIRED``
(cases/coverage.py), whatever the seed.

Which axis values a night of drawn cases reaches depends on its seed (one night drew only lower-bound gates
and 3 fp32 cases), and some production shapes were never drawn at all (an explicit scale, K = V = 128 in
fp32). These cases fix what must be reached and let the seed vary the rest: each required axis's values are
dealt over the cases in a shuffled cycle (so every value lands on some case), and every other axis (regimes,
the in-kernel flags, the initial state's kind, where a length falls among the chunks, the scale's value) is
drawn. They run on every backend (conformance/test_corpus.py), and their kernel configurations are the pool
the night's drawn cases take theirs from (cases/strategies.with_kernel_pool), so they add no compile.
"""

from __future__ import annotations

import random

from kda_cases.case import BETA_REGIMES, DTYPES, GATE_REGIMES, GATES, INITIAL_STATES, KEY_REGIMES, Case
from kda_cases.coverage import CHUNK

# (K, V) of each case: K and V each take 32, 64, 128 and 256, and the first three are the production size
# K = V = 128 in bf16, fp16 and fp32.
HEAD_DIMS = ((128, 128), (128, 128), (128, 128), (32, 64), (64, 32), (256, 256), (64, 128))
LOWER_BOUNDS = (-5.0, -1.0, -0.01)
EDGES = ("64m - 1", "64m", "64m + 1", "2047", "2048", "2049")


def _dealt(rng: random.Random, values: tuple, count: int) -> list:
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


def _heads(rng: random.Random, count: str) -> tuple[int, int]:
    if count == "1":
        return 1, 1
    if count == "2-7":
        heads = rng.randint(2, 7)
        return heads, heads
    if count == ">= 8":
        heads = rng.choice((8, 16))
        return heads, heads
    heads = rng.choice((1, 2, 4))  # GVA: more value heads than query heads
    return heads, heads * rng.choice((2, 4))


def _gate(rng: random.Random, form: str) -> dict:
    rule = GATES[form].bound
    if rule == "required":
        return {"gate": form, "lower_bound": rng.choice(LOWER_BOUNDS), "safe_gate": True}
    if rule == "none":
        return {"gate": form, "lower_bound": None, "safe_gate": False}
    bound = rng.choice((None, *LOWER_BOUNDS))  # with or without the safe gate's bound
    return {"gate": form, "lower_bound": bound, "safe_gate": bound is not None}


def guaranteed_cases(seed: int | None) -> list[Case]:
    """The night's guaranteed cases for ``seed`` (the same cases for the same seed)."""
    rng = random.Random(seed)
    count = len(HEAD_DIMS)
    gates = _dealt(rng, ("lower_bound", "softplus", "log"), count)  # GATE_FORMS, in the order the seeds were drawn
    state_dtypes = _dealt(rng, ("fp32", "bf16"), count)
    layouts = _dealt(rng, ("k_first", "v_first"), count)
    scales = _dealt(rng, (False, True), count)
    head_counts = _dealt(rng, ("1", "2-7", ">= 8", "GVA"), count)
    packings = _dealt(rng, ("one sequence", "[B, T] batch with h0", "packed, a zero-length member"), count)
    edges = _dealt(rng, EDGES, count)
    checkpoints = _dealt(rng, ("on", "off", "none"), count)
    cases = []
    for i, (head_k_dim, head_v_dim) in enumerate(HEAD_DIMS):
        length = _length(rng, edges[i])
        heads, v_heads = _heads(rng, head_counts[i])
        initial_state = rng.choice(INITIAL_STATES)
        if packings[i] == "one sequence":
            seq_lens, packed = (length,), False
        elif packings[i] == "[B, T] batch with h0":
            seq_lens, packed = (length,) * rng.randint(2, 3), False
            initial_state = rng.choice(INITIAL_STATES[1:])
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
                num_heads=heads,
                num_v_heads=v_heads,
                head_k_dim=head_k_dim,
                head_v_dim=head_v_dim,
                dtype=DTYPES[i] if i < len(DTYPES) else rng.choice(DTYPES),
                state_dtype=state_dtypes[i],
                **_gate(rng, gates[i]),
                gate_regime=rng.choice(GATE_REGIMES),
                key_regime=key_regime,
                key_rho=rng.choice((0.9, 0.99, 1.0)) if key_regime == "correlated" else 0.0,
                beta_regime=rng.choice(BETA_REGIMES),
                l2norm_in_kernel=rng.random() < 0.5,
                beta_sigmoid_in_kernel=rng.random() < 0.5,
                initial_state=initial_state,
                state_layout=layouts[i],
                checkpoints=marks,
                scale=rng.choice((0.5, 1.0, 2.0)) / head_k_dim**0.5 if scales[i] else None,
                seed=rng.randrange(2**31),
                tags=("guaranteed",),
            )
        )
    return cases
