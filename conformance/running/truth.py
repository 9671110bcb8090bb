"""What every backend on a case is measured against: its inputs, the float64 truth, and the budgets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kda_cases.case import Case
from kda_cases.materialize import KDAInputs, materialize
from kda_conformance.judging.metrics import measure_result
from kda_conformance.judging.tolerance import DEFAULT_RULE, BudgetRule, case_budgets
from kda_conformance.running.stages import CLOCK
from kda_kernels import registry
from kda_kernels.guard import run_backend_call
from kda_kernels.protocol import WorkingPrecision
from kda_kernels.torch_chunk import TorchChunk
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
    # The working precision the budgets were set at (None: the case's own, the strict baseline's); truths a
    # check derives from this one (a request, a step) are set at it too.
    precision: WorkingPrecision | None = None


def case_truth(
    case: Case,
    device: torch.device,
    rule: BudgetRule = DEFAULT_RULE,
    precision: WorkingPrecision | None = None,
    drawn: KDAInputs | None = None,
) -> CaseTruth:
    """Materialize ``case`` on ``device`` (from its ``drawn`` CPU tensors where they were drawn ahead), run
    the reference and the same-precision baseline, derive budgets (at a declared working precision where
    one is given)."""
    with CLOCK.stage("materialize", device):
        inputs = materialize(case, device, drawn)
    return inputs_truth(inputs, rule, precision)


def inputs_truth(
    inputs: KDAInputs, rule: BudgetRule = DEFAULT_RULE, precision: WorkingPrecision | None = None
) -> CaseTruth:
    """The truth and budgets of given inputs (``inputs.case`` describes them; its initial state is the
    tensor's, which may be a stored state a request resumes from), at ``precision`` where one is declared."""
    case, device = inputs.case, inputs.device
    form = reference_form(inputs)
    with CLOCK.stage("reference", device, form) as lap:
        reference = run_reference(inputs, form)
    with CLOCK.stage("baseline", device):
        baseline = run_backend_call(registry.get(BASELINE), inputs)  # it must not write the inputs either
    with CLOCK.stage("compare", device):
        budgets = case_budgets(case, reference, measure_result(case, reference, baseline), rule)
    strict = CaseTruth(case, inputs, reference, form, budgets, lap.seconds)
    return strict if precision is None else at_precision(strict, precision, rule)


def at_precision(strict: CaseTruth, precision: WorkingPrecision, rule: BudgetRule = DEFAULT_RULE) -> CaseTruth:
    """The truth with its budgets set by the baseline at a declared working precision (kernels/torch_chunk.py
    ``TorchChunk.at_precision``), each keeping the strict budget beside it: the same inputs and float64
    truth, another baseline."""
    inputs, case, device = strict.inputs, strict.case, strict.inputs.device
    with CLOCK.stage("baseline", device):
        baseline = run_backend_call(TorchChunk.at_precision(precision), inputs)
    with CLOCK.stage("compare", device):
        measured = measure_result(case, strict.reference, baseline)
        declared = case_budgets(case, strict.reference, measured, rule, declared_dtype=precision.state_dtype)
    budgets = {
        name: dataclasses.replace(budget, precision=precision.label, strict=strict.budgets[name])
        for name, budget in declared.items()
    }
    return dataclasses.replace(strict, budgets=budgets, precision=precision)
