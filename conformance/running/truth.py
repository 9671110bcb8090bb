"""What every backend on a case is measured against: its inputs, the float64 truth, and the budgets."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kda_cases.case import Case
from kda_cases.materialize import KDAInputs, materialize
from kda_conformance.judging.metrics import measure_result
from kda_conformance.judging.tolerance import DEFAULT_RULE, BudgetRule, case_budgets
from kda_conformance.running.stages import CLOCK
from kda_kernels import registry
from kda_kernels.guard import run_backend_call
from kda_reference.recurrent import ReferenceResult
from kda_reference.run import reference_form, run_reference
from kda_reports.findings import Budget

# The same-precision baseline the tolerance rule scales (kernels/torch_chunk.py), by its registered name.
BASELINE = registry.BASELINE


@dataclass(frozen=True)
class CaseTruth:
    """Inputs, float64 truth and budgets of one case."""

    case: Case
    inputs: KDAInputs
    reference: ReferenceResult
    reference_form: str  # "loop" or "chunked"
    budgets: dict[str, Budget]
    reference_seconds: float


def case_truth(case: Case, device: torch.device, rule: BudgetRule = DEFAULT_RULE) -> CaseTruth:
    """Materialize ``case`` on ``device``, run the reference and the same-precision baseline, derive budgets."""
    with CLOCK.stage("materialize", device):
        inputs = materialize(case, device)
    return inputs_truth(inputs, rule)


def inputs_truth(inputs: KDAInputs, rule: BudgetRule = DEFAULT_RULE) -> CaseTruth:
    """The truth and budgets of given inputs (``inputs.case`` describes them; its initial state is the
    tensor's, which may be a stored state a request resumes from)."""
    case, device = inputs.case, inputs.device
    form = reference_form(inputs)
    with CLOCK.stage("reference", device, form) as lap:
        reference = run_reference(inputs, form)
    with CLOCK.stage("baseline", device):
        baseline = run_backend_call(registry.get(BASELINE), inputs)  # it must not write the inputs either
    with CLOCK.stage("compare", device):
        budgets = case_budgets(case, reference, measure_result(case, reference, baseline), rule)
    return CaseTruth(case, inputs, reference, form, budgets, lap.seconds)
