"""The tolerance policy: the limits each checked tensor is held to, derived from a stated rule.

Each tensor (output, final state, checkpoint states) gets two limits, one per
budgeted metric, by one rule (docs/tolerance.md gives the reasons and the
calibration behind it)::

    limit    = min(cap, max(factor * baseline, floor))
    baseline = the metric of the same-precision PyTorch baseline (backend ``torch_chunk``) on the case
    floor    = u(stored dtype) + 5 sqrt(n) u(fp32)   for rel-RMS
               (u(stored dtype) + sqrt(25 + 2 ln N) sqrt(n) u(fp32)) max|reference|   for max-abs
    cap      = sqrt(u(working dtype))               (times max|reference| for max-abs)

``u`` is the unit roundoff (2^-8 for bf16, 2^-11 for fp16, 2^-24 for fp32) and
``n`` the longest sequence of the case. The floor's first term is what storing
the exact answer in the tensor's own dtype may cost, so an exact baseline
still leaves a positive budget; its second is Higham and Mary's probabilistic
bound lambda sqrt(n) u on the rounding error of ``n`` float32 steps, with
lambda = 5 (it holds with probability 1 - 2 exp(-lambda^2 / 2) = 1 - 7e-6): the
accumulation every kernel does in float32 whatever the order of its
arithmetic. A token-serial kernel rounds its state once per token and a
chunked one once per chunk, so a float32 baseline of one order does not bound
the other (FLA's recurrent kernel with weak gates and repeated keys carries an
fp32 error 7 times the chunked baseline's). Max-abs is the largest of ``N``
elements' errors, so its floor widens lambda to sqrt(lambda^2 + 2 ln N), at which
the maximum stays below it with the same probability (a union bound over the
elements). The cap (half the working precision's digits) keeps a baseline that
itself breaks down from excusing a kernel that breaks down with it. Max-abs is
the headline metric; its factor is larger because a maximum over millions of
elements is a noisy statistic, while rel-RMS, an average, tracks a kernel's
error level closely, so its tighter factor is what catches a kernel whose error
has merely doubled.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kda_cases.case import Case
from kda_cases.dtypes import PARAMETER_GRADIENTS, UNIT_ROUNDOFF, stored_dtype_name
from kda_conformance.judging.metrics import Measurement, Tensors
from kda_reports.findings import Budget, Errors, Limit


@dataclass(frozen=True)
class BudgetRule:
    """The constants of the rule; DEFAULT_RULE is the one the suite's verdicts use."""

    max_abs_factor: float = 4.0
    rel_rms_factor: float = 2.0
    floor_ulps: float = 1.0
    floor_lambda: float = 5.0
    working_fraction: float = 0.25

    def __post_init__(self) -> None:
        for name in ("max_abs_factor", "rel_rms_factor", "floor_ulps", "floor_lambda", "working_fraction"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"BudgetRule.{name} must be a positive finite number, got {value!r}")


DEFAULT_RULE = BudgetRule()
# The largest chunk a KDA kernel is known to take (AITER's chunk_size, the baseline's 128-token variant): its
# triangular solve and sums of that length round in float32 whatever the sequence's length.
LARGEST_CHUNK = 128


class InvalidTruth(ValueError):
    """The case cannot be judged: its float64 truth or its baseline is not finite. A budget from either
    would be meaningless (a NaN limit, or the cap where the floor belongs), so it is an error of the suite's
    case, named, and no backend's verdict."""


def _limit(metric: str, factor: float, baseline: float, floor: float, cap: float) -> Limit:
    cap = max(cap, floor)
    scaled = factor * baseline
    if baseline > cap:  # the working precision itself breaks down here: no kernel is held past the baseline
        return Limit(metric, baseline, baseline, floor, cap, "breakdown")
    if scaled >= cap:
        return Limit(metric, cap, baseline, floor, cap, "cap")
    if scaled >= floor:
        return Limit(metric, scaled, baseline, floor, cap, "baseline")
    return Limit(metric, floor, baseline, floor, cap, "floor")


def derive_budget(
    case: Case,
    tensor: str,
    baseline: Errors,
    reference_max_abs: float,
    rule: BudgetRule = DEFAULT_RULE,
    elements: int = 1,
    declared_roundoff: float = 0.0,
    terms_max_abs: float = 0.0,
    stored_share: float = 1.0,
    least: tuple[float, float] | None = None,
) -> Budget:
    """Apply the rule to one tensor, given the baseline's errors on it, the reference's largest magnitude
    and the tensor's number of elements (the max-abs floor covers the largest of that many errors). A
    ``declared_roundoff`` (a backend's declared working precision: the unit roundoff of its state's dtype or
    of its TF32 dots) is part of the working precision the cap is taken from.

    A tensor computed as a sum of larger terms that cancel (a gradient of the gate) gives their largest
    magnitude ``terms_max_abs``: the accumulation's share of the floor, and the cap, scale with it, while
    storing the result costs only its own magnitude; ``stored_share`` is the tensor's RMS over the RMS its
    rel-RMS is taken against (the terms', where larger), which the stored-dtype share of the rel-RMS floor
    is scaled by. ``least``: (max-abs, rel-RMS) below which neither floor goes, what rounding elsewhere is known
    to allow this tensor (dA_log: one channel's limit summed over its channels, running/gradient_truth.py)."""
    stored = UNIT_ROUNDOFF[stored_dtype_name(case, tensor)]
    working = max(UNIT_ROUNDOFF[case.dtype], stored, declared_roundoff)
    # A state stored in float32 is computed from intermediates kept in the input dtype: no correct kernel is
    # held below a quarter of that dtype's unit roundoff.
    resolution = max(stored, rule.working_fraction * working)
    # A parameter's gradient (A_log, dt_bias) sums over every token of every sequence, not one sequence's.
    steps = case.total_tokens if tensor in PARAMETER_GRADIENTS else max(case.seq_lens)
    growth = math.sqrt(steps + LARGEST_CHUNK) * UNIT_ROUNDOFF["fp32"]
    floor_rel_rms = rule.floor_ulps * resolution * stored_share + rule.floor_lambda * growth
    lambda_max = math.sqrt(rule.floor_lambda**2 + 2 * math.log(max(elements, 1)))
    magnitude = max(reference_max_abs, terms_max_abs)
    floor_max_abs = rule.floor_ulps * resolution * reference_max_abs + lambda_max * growth * magnitude
    if least is not None:
        floor_max_abs, floor_rel_rms = max(floor_max_abs, least[0]), max(floor_rel_rms, least[1])
    cap = math.sqrt(working)
    return Budget(
        tensor,
        _limit("max_abs", rule.max_abs_factor, baseline.max_abs, floor_max_abs, cap * magnitude),
        _limit("rel_rms", rule.rel_rms_factor, baseline.rel_rms, floor_rel_rms, cap),
    )


def case_budgets(
    case: Case,
    truth: Tensors,
    baseline: Iterable[Measurement],
    rule: BudgetRule = DEFAULT_RULE,
    declared_roundoff: float = 0.0,
) -> dict[str, Budget]:
    """Budgets for every tensor the baseline was measured on, keyed by tensor name (``declared_roundoff``: see
    ``derive_budget``)."""
    budgets = {}
    for measured in baseline:
        ref = getattr(truth, measured.tensor)
        bad = int((~ref.isfinite()).sum())
        if bad:
            raise InvalidTruth(f"case {case.id}: the float64 truth's {measured.tensor} holds {bad} non-finite values")
        errors = measured.errors
        if errors.nonfinite or not (math.isfinite(errors.max_abs) and math.isfinite(errors.rel_rms)):
            raise InvalidTruth(
                f"case {case.id}: the baseline ({measured.tensor}) is not finite ({errors.nonfinite} non-finite "
                "values): no budget can be derived from it"
            )
        ref_max = float(ref.abs().max()) if ref.numel() else 0.0
        budgets[measured.tensor] = derive_budget(
            case,
            measured.tensor,
            measured.errors,
            ref_max,
            rule,
            elements=ref.numel(),
            declared_roundoff=declared_roundoff,
        )
    return budgets
