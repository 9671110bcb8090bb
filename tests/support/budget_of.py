"""The budget check run directly on a case's truth, outside the executor (``Run.checked``), with the judge
the executor would have made: what the tests of adapters, the comparison and the record schema need."""

from __future__ import annotations

from kda_conformance.checks import budget
from kda_conformance.judging.judge import judge_for
from kda_conformance.running.truth import CaseTruth
from kda_kernels.protocol import Backend
from kda_reports.findings import Finding


def budget_check(truth: CaseTruth, backend: Backend) -> list[Finding]:
    judge = judge_for(budget.CHECK.name, truth.case, backend.name, truth.inputs.device)
    return budget.run(truth, backend, {}, judge)
