"""The tolerance policy: budgets per checked tensor, derived from a stated rule, and the verdict.

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
elements). The cap (half the
working precision's digits) keeps a baseline that itself breaks down from
excusing a kernel that breaks down with it. Max-abs is the headline metric; its factor is
larger because a maximum over millions of elements is a noisy statistic, while
rel-RMS, an average, tracks a kernel's error level closely, so its tighter
factor is what catches a kernel whose error has merely doubled.

Besides the budgets, hard checks: a wrong shape or dtype, or any NaN or Inf,
fails whatever the numbers say.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kda_cases.case import Case
from kda_cases.materialize import TORCH_DTYPES
from kda_conformance.compare import TensorError, first_bad
from kda_kernels.protocol import BackendOutput
from kda_reference.recurrent import ReferenceResult

UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 2.0**-24}


@dataclass(frozen=True)
class BudgetRule:
    """The constants of the rule; DEFAULT_RULE is the one the suite's verdicts use."""

    max_abs_factor: float = 4.0
    rel_rms_factor: float = 2.0
    floor_ulps: float = 1.0
    floor_lambda: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_abs_factor", "rel_rms_factor", "floor_ulps", "floor_lambda"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"BudgetRule.{name} must be a positive finite number, got {value!r}")


DEFAULT_RULE = BudgetRule()


@dataclass(frozen=True)
class Limit:
    """One metric's limit and the terms it came from; ``binding`` names the term that set it."""

    metric: str  # "max_abs" or "rel_rms"
    value: float
    baseline: float
    floor: float
    cap: float
    binding: str  # "baseline", "floor" or "cap"


@dataclass(frozen=True)
class Budget:
    tensor: str
    max_abs: Limit
    rel_rms: Limit


def stored_dtype(case: Case, tensor: str) -> str:
    """The dtype a tensor is stored in: outputs in the input dtype, states in the case's state dtype."""
    return case.dtype if tensor == "o" else case.state_dtype


def _limit(metric: str, factor: float, baseline: float, floor: float, cap: float) -> Limit:
    cap = max(cap, floor)
    # A non-finite baseline means the baseline broke down: unbounded, so the cap decides.
    scaled = factor * baseline if math.isfinite(baseline) else math.inf
    if scaled >= cap:
        return Limit(metric, cap, baseline, floor, cap, "cap")
    if scaled >= floor:
        return Limit(metric, scaled, baseline, floor, cap, "baseline")
    return Limit(metric, floor, baseline, floor, cap, "floor")


def derive_budget(
    case: Case,
    tensor: str,
    baseline: TensorError,
    reference_max_abs: float,
    rule: BudgetRule = DEFAULT_RULE,
    elements: int = 1,
) -> Budget:
    """Apply the rule to one tensor, given the baseline's errors on it, the reference's largest magnitude
    and the tensor's number of elements (the max-abs floor covers the largest of that many errors)."""
    stored = UNIT_ROUNDOFF[stored_dtype(case, tensor)]
    working = max(UNIT_ROUNDOFF[case.dtype], stored)
    growth = math.sqrt(max(case.seq_lens)) * UNIT_ROUNDOFF["fp32"]
    floor_rel_rms = rule.floor_ulps * stored + rule.floor_lambda * growth
    lambda_max = math.sqrt(rule.floor_lambda**2 + 2 * math.log(max(elements, 1)))
    floor_max_abs = (rule.floor_ulps * stored + lambda_max * growth) * reference_max_abs
    cap = math.sqrt(working)
    return Budget(
        tensor,
        _limit("max_abs", rule.max_abs_factor, baseline.max_abs, floor_max_abs, cap * reference_max_abs),
        _limit("rel_rms", rule.rel_rms_factor, baseline.rel_rms, floor_rel_rms, cap),
    )


def case_budgets(
    case: Case, truth: ReferenceResult, baseline_errors: list[TensorError], rule: BudgetRule = DEFAULT_RULE
) -> dict[str, Budget]:
    """Budgets for every tensor the baseline was compared on, keyed by tensor name."""
    wanted = {"o": truth.o, "final_state": truth.final_state, "checkpoint_states": truth.checkpoint_states}
    budgets = {}
    for err in baseline_errors:
        ref = wanted[err.tensor]
        ref_max = float(ref.abs().max()) if ref.numel() else 0.0
        budgets[err.tensor] = derive_budget(case, err.tensor, err, ref_max, rule, elements=ref.numel())
    return budgets


@dataclass(frozen=True)
class TensorVerdict:
    """One tensor of one backend on one case: its errors, its budget, and whether it passed."""

    error: TensorError
    budget: Budget
    problems: tuple[str, ...]  # empty when it passed
    first_bad: str

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def ratio(self) -> float:
        """max-abs / its limit."""
        return _ratio(self.error.max_abs, self.budget.max_abs.value)

    @property
    def rel_rms_ratio(self) -> float:
        """rel-RMS / its limit."""
        return _ratio(self.error.rel_rms, self.budget.rel_rms.value)


def _ratio(value: float, limit: float) -> float:
    if limit > 0:
        return value / limit
    return 0.0 if value == 0 else math.inf


def returned_dtype(result: BackendOutput, tensor: str) -> torch.dtype | None:
    value = {"o": result.o, "final_state": result.final_state, "checkpoint_states": result.checkpoint_states}[tensor]
    return None if value is None else value.dtype


def judge(case: Case, error: TensorError, budget: Budget, dtype: torch.dtype | None) -> TensorVerdict:
    """The verdict on one tensor: hard checks first (shape, dtype, non-finite values), then the budget."""
    problems = []
    if not error.shape_ok:
        problems.append(error.detail or "wrong shape")
    expected = TORCH_DTYPES[stored_dtype(case, error.tensor)]
    if dtype is not None and dtype != expected:
        problems.append(f"dtype {str(dtype).removeprefix('torch.')} != expected {str(expected).removeprefix('torch.')}")
    if error.nonfinite:
        problems.append(f"{error.nonfinite} non-finite values")
    # NaN compares false with everything: a metric that is not <= its limit fails, NaN included.
    for limit in (budget.max_abs, budget.rel_rms):
        value = getattr(error, limit.metric)
        if error.shape_ok and not value <= limit.value:
            problems.append(f"{limit.metric} {value:.3e} > limit {limit.value:.3e} (set by the {limit.binding})")
    return TensorVerdict(error, budget, tuple(problems), first_bad(case, error, budget.max_abs.value))


def failure_message(case: Case, backend: str, verdict: TensorVerdict, repro: str) -> str:
    """Everything a kernel engineer needs from one failed tensor, on a few lines."""
    e = verdict.error
    lines = [f"{case.id} ({case.label}) backend {backend} tensor {e.tensor}: " + "; ".join(verdict.problems)]
    for limit in (verdict.budget.max_abs, verdict.budget.rel_rms):
        lines.append(
            f"  {limit.metric} = {getattr(e, limit.metric):.3e}, limit {limit.value:.3e} "
            f"(baseline {limit.baseline:.3e}, floor {limit.floor:.3e}, cap {limit.cap:.3e})"
        )
    lines.append(f"  first bad: {verdict.first_bad or '-'} (first point past the max-abs limit)")
    lines.append(f"  repro: {repro}")
    return "\n".join(lines)
