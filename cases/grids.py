"""Fixed grids of cases: the first sweep (``kda-conformance run``, ``test_first_sweep``) and the calibration grid."""

from __future__ import annotations

from collections.abc import Sequence

from kda_cases.case import Case

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
