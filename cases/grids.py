"""Fixed grids of cases: the first sweep (``kda-conformance run``, ``test_first_sweep``) and the calibration grid."""

from __future__ import annotations

import random
from collections.abc import Sequence

from kda_cases.case import GATE_REGIMES, INITIAL_STATES, Case

FIRST_SWEEP_LENGTHS = (37, 64, 65, 130)
FIRST_SWEEP_DTYPES = ("bf16", "fp32")
# The calibration grid's default regimes: a subset of the Case axes (`reset` gates and `large` initial states
# are left to the generated sweeps); any value of the axis may be asked for.
CALIBRATION_GATE_REGIMES = ("typical", "weak", "strong")
CALIBRATION_INITIAL_STATES = ("none", "random")


def first_sweep_cases(
    lengths: Sequence[int] = FIRST_SWEEP_LENGTHS,
    dtypes: Sequence[str] = FIRST_SWEEP_DTYPES,
    num_heads: int = 2,
    head_dim: int = 64,
    seed: int = 0,
) -> list[Case]:
    """The fixed cases of the first sweep: each length x dtype x (no h0, random h0), plus one packed batch."""
    base = Case(num_heads=num_heads, num_v_heads=num_heads, head_k_dim=head_dim, head_v_dim=head_dim, seed=seed)
    cases = [
        base.replace(seq_lens=(T,), dtype=dtype, initial_state=h0)
        for T in lengths
        for dtype in dtypes
        for h0 in ("none", "random")
    ]
    packed = (min(lengths), 0, max(lengths), 17)
    cases.append(base.replace(seq_lens=packed, packed=True, dtype=dtypes[0], initial_state="random"))
    return cases


def calibration_cases(
    lengths: Sequence[int],
    dtypes: Sequence[str],
    num_heads: int,
    head_dim: int,
    gate_regimes: Sequence[str] = CALIBRATION_GATE_REGIMES,
    initial_states: Sequence[str] = CALIBRATION_INITIAL_STATES,
    seed: int = 0,
) -> list[Case]:
    """The calibration grid, shortest cases first so that a run cut short still covers every regime at
    small sizes."""
    base = Case(num_heads=num_heads, num_v_heads=num_heads, head_k_dim=head_dim, head_v_dim=head_dim, seed=seed)
    return [
        base.replace(seq_lens=(T,), dtype=dtype, gate_regime=regime, initial_state=h0, tags=("calibration",))
        for T in sorted(lengths)
        for dtype in dtypes
        for regime in gate_regimes
        for h0 in initial_states
    ]


# Each long case's kernel configuration, by dtype and its occurrence in the profile's list: (query heads,
# value heads, two packed halves, an initial state), at K = V = 128 and the safe gate: configurations the
# sentinels and the guaranteed cases have (cases/sentinels.json, cases/guarantee.py) or the corpus
# (8 heads, packed halves from a state), so that a night's long cases compile nothing of their own.
# The long backward cases' seed is the run's with these bits flipped: inputs of their own.
LONG_BACKWARD_STREAM = 0x6261636B

LONG_SHAPES = {
    "bf16": ((4, 8, False, False), (8, 8, True, True)),
    "fp16": ((4, 8, False, True),),
    "fp32": ((4, 8, False, False),),
}


def long_cases(dtypes: Sequence[str], tokens: int, seed: int | None) -> list[Case]:
    """A run's long cases: one of ``tokens`` tokens per entry of ``dtypes`` (K = V = 128, the safe gate;
    the heads, one sequence or two packed halves, and an initial state or none as ``LONG_SHAPES`` fixes
    them), their other axes (gate regime, keys, the initial state's kind, the inputs)
    drawn from ``seed``, so every night reaches long contexts in every dtype with new inputs and the same
    kernels."""
    rng = random.Random(seed)
    cases = []
    for i, dtype in enumerate(dtypes):
        shapes = LONG_SHAPES[dtype]  # the dtype's shapes in turn, by its occurrence in the list
        heads, v_heads, halves, with_h0 = shapes[dtypes[:i].count(dtype) % len(shapes)]
        cases.append(
            Case(
                seq_lens=(tokens // 2, tokens - tokens // 2) if halves else (tokens,),
                packed=halves,
                num_heads=heads,
                num_v_heads=v_heads,
                head_k_dim=128,
                head_v_dim=128,
                dtype=dtype,
                gate_regime=rng.choice(GATE_REGIMES),
                key_regime=rng.choice(("random", "random", "correlated")),
                key_rho=0.99,
                initial_state=rng.choice(INITIAL_STATES[1:]) if with_h0 else "none",
                seed=rng.randrange(2**31),
                tags=("long",),
            )
        )
    return [c if c.key_regime == "correlated" else c.replace(key_rho=0.0) for c in cases]


def long_backward_cases(dtypes: Sequence[str], tokens: int, seed: int | None) -> list[Case]:
    """A run's long backward cases: one of ``tokens`` tokens per entry of ``dtypes``, two packed halves with
    initial states (so that dh0 and the sequences' boundaries are measured), K = V = 128 and 8 heads (the
    kernel configuration of the second bf16 long case: no compile of its own in a night; the drawn cases of
    the gradients check take grouped value heads), their other axes drawn from ``seed`` (a stream apart from
    the long cases')."""
    drawn = long_cases(dtypes, tokens, None if seed is None else seed ^ LONG_BACKWARD_STREAM)
    return [
        case.replace(
            seq_lens=(tokens // 2, tokens - tokens // 2),
            packed=True,
            num_heads=8,
            num_v_heads=8,
            initial_state=case.initial_state if case.initial_state != "none" else "random",
            tags=("long", "backward"),
        )
        for case in drawn
    ]
