"""The tolerance policy on synthetic results: budgets from the rule, hard checks, messages."""

from __future__ import annotations

import math

import pytest
import torch

from kda_cases.case import Case
from kda_cases.dtypes import UNIT_ROUNDOFF
from kda_cases.materialize import materialize
from kda_conformance.judging.judge import Judge
from kda_conformance.judging.metrics import measure, measure_result
from kda_conformance.judging.tolerance import BudgetRule, InvalidTruth, case_budgets, derive_budget
from kda_kernels.torch_chunk import TorchChunk
from kda_reference.run import run_reference
from kda_reports.findings import Budget, Finding, Limit

CASE = Case(seq_lens=(4,), num_heads=1, num_v_heads=1, head_k_dim=4, head_v_dim=2)
F64 = torch.float64


def judge(got: torch.Tensor, want: torch.Tensor, budget: Budget, dtype: torch.dtype | None = None) -> Finding:
    """The budget check's verdict on ``got`` as the output of a kernel called my_kernel."""
    judge = Judge("budget", CASE, "my_kernel", "cpu", "kda-conformance run --case X")
    return judge.verdict(measure(budget.tensor, got, want), budget, dtype)


def tensor_error(name: str, got: torch.Tensor, want: torch.Tensor):
    return measure(name, got, want).errors


def fixed_budget(max_abs: float, rel_rms: float = math.inf) -> Budget:
    return Budget(
        "o",
        Limit("max_abs", max_abs, max_abs, 0.0, max_abs, "baseline"),
        Limit("rel_rms", rel_rms, rel_rms, 0.0, rel_rms, "baseline"),
    )


def test_budget_edges_on_max_abs() -> None:
    want = torch.zeros(1, 4, 1, 2, dtype=F64)
    budget = fixed_budget(1e-3)
    assert judge(want + 0.99e-3, want, budget).passed
    failed = judge(want + 1.01e-3, want, budget)
    assert not failed.passed and "max_abs 1.010e-03 > limit 1.000e-03" in failed.problems[0]


def test_budget_edges_on_rel_rms() -> None:
    want = torch.ones(1, 4, 1, 2, dtype=F64)
    budget = fixed_budget(1.0, rel_rms=1e-2)
    assert judge(want * 1.0099, want, budget).passed
    assert not judge(want * 1.0101, want, budget).passed


def test_nan_fails_even_with_an_unbounded_budget() -> None:
    want = torch.ones(1, 4, 1, 2, dtype=F64)
    got = want.clone()
    got[0, 2, 0, 1] = float("nan")
    verdict = judge(got, want, fixed_budget(math.inf))
    assert not verdict.passed
    assert "1 non-finite value" in verdict.problems
    assert str(verdict.first_bad) == "seq 0 token 2 head 0"


def test_wrong_dtype_and_shape_fail() -> None:
    want = torch.ones(1, 4, 1, 2, dtype=F64)
    verdict = judge(want.to(torch.float32), want, fixed_budget(1.0, 1.0), torch.float32)  # the case's dtype is bf16
    assert not verdict.passed and verdict.problems == ("dtype float32 != expected bfloat16",)
    assert not judge(torch.ones(1, 4, 2, 1), want, fixed_budget(1.0, 1.0), torch.bfloat16).passed


def test_zero_baseline_error_still_gives_a_positive_budget() -> None:
    exact = tensor_error("o", torch.ones(1, 4, 1, 2, dtype=F64), torch.ones(1, 4, 1, 2, dtype=F64))
    assert exact.max_abs == 0.0
    budget = derive_budget(CASE, "o", exact, reference_max_abs=3.0)
    floor = UNIT_ROUNDOFF["bf16"] + 5 * math.sqrt(4 + 128) * UNIT_ROUNDOFF["fp32"]  # 4 tokens and one 128-chunk
    assert budget.max_abs.binding == "floor" and budget.max_abs.value == pytest.approx(floor * 3.0)
    assert budget.rel_rms.binding == "floor" and budget.rel_rms.value == pytest.approx(floor)


def test_rule_scales_the_baseline() -> None:
    want = torch.ones(1, 4, 1, 2, dtype=F64)
    rule = BudgetRule(max_abs_factor=4.0, rel_rms_factor=2.0)
    budget = derive_budget(CASE, "o", tensor_error("o", want + 0.01, want), reference_max_abs=1.0, rule=rule)
    assert budget.max_abs.binding == "baseline" and budget.max_abs.value == pytest.approx(0.04)
    assert budget.rel_rms.binding == "baseline" and budget.rel_rms.value == pytest.approx(0.02)


@pytest.mark.parametrize("where", ["truth", "baseline"])
def test_a_non_finite_truth_or_baseline_makes_the_case_invalid_not_the_budget_looser(where: str) -> None:
    """Not the cap (5.6e-4 in fp32 where the floor is 1.7e-6), not a NaN limit: an error of the suite, named."""
    truth = run_reference(materialize(CASE, torch.device("cpu")))
    baseline = TorchChunk().run(materialize(CASE, torch.device("cpu")))
    if where == "truth":
        truth.o[0, 3, 0, 0] = float("nan")
    else:
        baseline.o[0, 3, 0, 0] = float("nan")
    with pytest.raises(InvalidTruth, match=f"case {CASE.id}: the (float64 truth's o|baseline \\(o\\))"):
        case_budgets(CASE, truth, measure_result(CASE, truth, baseline))


def test_state_budgets_use_the_state_dtype() -> None:
    zero = tensor_error("final_state", torch.zeros(1, 1, 4, 2, dtype=F64), torch.zeros(1, 1, 4, 2, dtype=F64))
    growth = 5 * math.sqrt(4 + 128) * 2.0**-24
    fp32_case = CASE.replace(dtype="fp32")
    fp32_state = derive_budget(fp32_case, "final_state", zero, reference_max_abs=1.0)
    bf16_state = derive_budget(fp32_case.replace(state_dtype="bf16"), "final_state", zero, reference_max_abs=1.0)
    assert fp32_state.max_abs.value == pytest.approx(2.0**-24 + growth)
    assert bf16_state.max_abs.value == pytest.approx(2.0**-8 + growth)
    # An fp32 state computed from bf16 inputs: a quarter of bf16's unit roundoff, not float32's.
    from_bf16 = derive_budget(CASE, "final_state", zero, reference_max_abs=1.0)
    assert from_bf16.max_abs.value == pytest.approx(2.0**-10 + growth)


def test_where_the_baseline_breaks_down_past_the_cap_no_kernel_is_held_beyond_it() -> None:
    """A case the working precision cannot compute (the baseline past the cap): the limit is the baseline's own
    error, not the cap below it (a correct kernel as good as the baseline passes) nor a multiple of it."""
    want = torch.ones(1, 4, 1, 2, dtype=F64)
    broken = tensor_error("o", want + 0.5, want)  # 50 %: past bf16's cap of sqrt(2^-8) = 6.25 %
    budget = derive_budget(CASE, "o", broken, reference_max_abs=1.0)
    for limit in budget.limits:
        assert limit.binding == "breakdown" and limit.value == pytest.approx(limit.baseline) and limit.value > limit.cap
    message = judge(want + 0.6, want, budget, torch.bfloat16).message()
    assert "the working precision breaks down past the cap" in message


@pytest.mark.parametrize(
    "field", ["max_abs_factor", "rel_rms_factor", "floor_ulps", "floor_lambda", "working_fraction"]
)
def test_rule_constants_must_be_positive(field: str) -> None:
    with pytest.raises(ValueError, match=f"BudgetRule.{field} must be a positive finite number"):
        BudgetRule(**{field: 0.0})


def test_failure_message_names_everything_a_bug_report_needs() -> None:
    want = torch.zeros(1, 4, 1, 2, dtype=F64)
    got = want.clone()
    got[0, 3, 0, 0] = 0.5
    message = judge(got, want, fixed_budget(0.1), torch.bfloat16).message()
    for part in (
        CASE.id,
        CASE.label,
        "my_kernel",
        "tensor o",
        "max_abs = 5.000e-01",
        "limit 1.000e-01",
        "first bad: seq 0 token 3 head 0",
        "repro: kda-conformance run --case X",
    ):
        assert part in message, part


def test_a_failure_of_the_rel_rms_limit_alone_names_where_the_error_is_largest() -> None:
    # Every output a little off, none past the max-abs limit: a scale error, which "first bad: -" hid.
    want = torch.ones(1, 4, 1, 2, dtype=F64)
    got = want * 1.01
    got[0, 2, 0, 1] = 1.03
    finding = judge(got, want, fixed_budget(0.1, rel_rms=1e-3), torch.bfloat16)
    assert finding.failed and finding.errors.max_abs < 0.1
    assert str(finding.first_bad) == "seq 0 token 2 head 0"
    assert "largest error: seq 0 token 2 head 0 (no point past the max-abs limit)" in finding.message()
    # Past the max-abs limit the first bad point is still the first one past it, not the largest.
    got[0, 1, 0, 0], got[0, 3, 0, 0] = 1.2, 1.5
    finding = judge(got, want, fixed_budget(0.1, rel_rms=1e-3), torch.bfloat16)
    assert str(finding.first_bad) == "seq 0 token 1 head 0" and "first bad: seq 0 token 1 head 0" in finding.message()


def test_a_sequence_run_alone_is_located_in_that_sequence_of_the_case() -> None:
    """A packed case's second sequence run by itself (packing and gradients checks): its first bad point is that
    sequence's token, not the first sequence's (it was named "seq 0 token 16" for sequence 1's token 16)."""
    case = Case(seq_lens=(20, 17), packed=True, num_heads=1, num_v_heads=1, head_k_dim=4, head_v_dim=2)
    judge = Judge("packing", case, "my_kernel", "cpu", "kda-conformance run --case X")
    want = torch.zeros(1, 17, 1, 2, dtype=F64)
    got = want.clone()
    got[0, 16, 0, 1] = 1.0
    for check in (lambda: judge.verdict(measure("o", got, want), fixed_budget(1e-3), None, alone=1),
                  lambda: judge.tensor("o", got, want, fixed_budget(1e-3), alone=1)):  # fmt: skip
        where = check().first_bad
        assert where is not None and (where.sequence, where.token, where.head) == (1, 16, 0)
    state = torch.zeros(1, 1, 4, 2, dtype=F64)
    where = judge.tensor("final_state", state + 1.0, state, fixed_budget(1e-3), alone=1).first_bad
    assert where is not None and (where.sequence, where.head) == (1, 0)


def test_rel_rms_counts_the_largest_error_less_one_ulp_and_every_other_error_whole() -> None:
    """FLA's chunk backward returned one dg element of a 5-token sequence as 8.25 where the exact value is 8.1877
    (bf16 rounds it to 8.1875): 99.99 % of that part's squared error, which its rel-RMS limit failed at 1.88x.
    One element on the other neighbour of its exact value is rounding; the rest of a larger error, and an error
    spread over the elements, still count."""
    want = torch.full((1, 5, 1, 4), 0.1, dtype=F64)
    want[0, 2, 0, 3] = 8.1877
    nearest = want.to(torch.bfloat16)
    rounding = tensor_error("o", nearest, want).rel_rms

    def rel_rms_with(value: float) -> float:
        got = nearest.clone()
        got[0, 2, 0, 3] = value
        return tensor_error("o", got, want).rel_rms

    assert rel_rms_with(8.25) == pytest.approx(rounding, rel=1e-12)  # one ulp (0.0625) up: the other neighbour
    rms = float(want.pow(2).mean().sqrt())
    two_ulps_left = math.sqrt(rounding**2 + (8.3125 - 8.1877 - 0.0625) ** 2 / want.numel() / rms**2)
    assert rel_rms_with(8.3125) == pytest.approx(two_ulps_left, rel=1e-6)  # two up: one of them counts
    got = nearest.clone()
    got[0, 2, 0, 3] = 8.25
    assert tensor_error("o", got, want).max_abs == pytest.approx(8.25 - 8.1877)  # max-abs is the whole error
    level = torch.linspace(0.5, 0.9, 20, dtype=F64).reshape(1, 5, 1, 4)
    spread = level.to(torch.bfloat16).nextafter(torch.tensor(math.inf, dtype=torch.bfloat16))  # each one ulp up
    whole = float((spread.double() - level).pow(2).mean().sqrt() / level.pow(2).mean().sqrt())
    assert tensor_error("o", spread, level).rel_rms > 0.9 * whole
