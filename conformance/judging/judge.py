"""From measurements to findings: the hard checks, the limits, the first bad point."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kda_cases.case import Case
from kda_cases.dtypes import dtype_name, stored_dtype
from kda_conformance.judging.metrics import Measurement, Tensors, locate, locate_largest, measure, measure_result
from kda_conformance.judging.repro import repro_line
from kda_reports.findings import Budget, Finding, Location

# How a failure names the term that set its limit (kda_reports.findings.Limit.binding).
SET_BY = {
    "baseline": "set by the baseline",
    "floor": "set by the floor",
    "cap": "set by the cap",
    "breakdown": "the baseline's own error: the working precision breaks down past the cap here",
}


def problems_of(case: Case, measurement: Measurement, budget: Budget, dtype: torch.dtype | None) -> list[str]:
    """Why a tensor fails, hard checks first (shape, dtype, non-finite values), then each limit it passes."""
    errors, problems = measurement.errors, []
    if not errors.shape_ok:
        problems.append(errors.detail or "wrong shape")
    expected = stored_dtype(case, measurement.tensor)
    if dtype is not None and dtype != expected:
        problems.append(f"dtype {dtype_name(dtype)} != expected {dtype_name(expected)}")
    if errors.nonfinite:
        problems.append(f"{errors.nonfinite} non-finite value{'s' if errors.nonfinite != 1 else ''}")
    # NaN compares false with everything: a metric that is not <= its limit fails, NaN included.
    for limit in budget.limits:
        value = getattr(errors, limit.metric)
        if errors.shape_ok and not value <= limit.value:
            problems.append(f"{limit.metric} {value:.3e} > limit {limit.value:.3e} ({SET_BY[limit.binding]})")
    return problems


@dataclass(frozen=True)
class Judge:
    """Makes the findings of one check of one backend on one case: every finding it makes names them and
    carries the check's repro line."""

    check: str
    case: Case
    backend: str
    device: str
    repro: str

    def verdict(
        self,
        measurement: Measurement,
        budget: Budget,
        dtype: torch.dtype | None,
        subject: str = "",
        alone: int | None = None,
        **extra: Any,
    ) -> Finding:
        """The finding on one measured tensor held to ``budget``; ``extra`` fills the finding's other fields.
        ``alone``: the tensor is that sequence's of the case, run by itself, where its first bad point lies."""
        problems = problems_of(self.case, measurement, budget, dtype)
        laid_out = self.case
        if alone is not None:
            _, start, end = self.case.row_spans[alone]
            if end > start:  # its tokens in one row; an empty sequence has a state only
                laid_out = self.case.replace(seq_lens=(end - start,), packed=True, checkpoints=())
        where = locate(laid_out, measurement, budget.max_abs.value)
        if where is None and problems:  # the rel-RMS limit alone: where the error is largest
            where = locate_largest(laid_out, measurement)
        if where is not None and alone is not None:
            where = dataclasses.replace(where, sequence=alone)
        return self._finding(
            "fail" if problems else "pass",
            tensor=measurement.tensor,
            subject=subject,
            errors=measurement.errors,
            budget=budget,
            problems=tuple(problems),
            first_bad=where,
            **extra,
        )

    def tensor(
        self,
        name: str,
        got: torch.Tensor | None,
        want: torch.Tensor,
        budget: Budget,
        subject: str = "",
        alone: int | None = None,
    ) -> Finding:
        """``got`` against ``want`` (the truth, or another run) with the case's budget for ``name`` (``alone``:
        see :meth:`verdict`)."""
        measured = measure(name, got, want.to(torch.float64))
        return self.verdict(measured, budget, None if got is None else got.dtype, subject, alone)

    def result(
        self, truth: Tensors, result: Tensors, budgets: dict[str, Budget], subject: str = "", **extra: Any
    ) -> list[Finding]:
        """A finding on every tensor ``result`` holds, against the truth and the case's budgets."""
        return [
            self.verdict(
                measured,
                budgets[measured.tensor],
                None if getattr(result, measured.tensor) is None else getattr(result, measured.tensor).dtype,
                subject,
                **extra,
            )
            for measured in measure_result(self.case, truth, result)
        ]

    def problem(self, subject: str, text: str, where: Location | None = None, tensor: str = "") -> Finding:
        """A failure that is not a tensor out of its limits: memory written that must not be, bits that moved."""
        return self._finding("fail", subject=subject, tensor=tensor, problems=(text,), first_bad=where)

    def passed(self, subject: str, tensor: str = "") -> Finding:
        """Nothing wrong with what ``subject`` names (a check with no tensor to measure)."""
        return self._finding("pass", subject=subject, tensor=tensor)

    def not_compared(self, tensor: str, reason: str) -> Finding:
        """A tensor of the case that the result lacks and may lack (a backend that returns no checkpoint
        states): a skip of that tensor, with the reason, beside the findings on the others."""
        return self._finding("skip", tensor=tensor, reason=reason)

    def outcome(self, verdict: str, reason: str, seconds: float = 0.0) -> Finding:
        """A call that did not give tensors to judge: ``skip`` (unsupported) or ``error`` (it raised)."""
        return self._finding(verdict, reason=reason, seconds=seconds)

    def _finding(self, verdict: str, **fields: Any) -> Finding:  # Finding's own fields, by name
        return Finding(
            check=self.check,
            case=self.case,
            backend=self.backend,
            device=self.device,
            verdict=verdict,
            repro=self.repro,
            **fields,
        )


def judge_for(
    check: str, case: Case, backend: str, device: torch.device, params: Mapping[str, object] | None = None
) -> Judge:
    """The judge of ``check`` on ``case``, its findings carrying the repro line of exactly this run."""
    return Judge(check, case, backend, str(device), repro_line(check, case, backend, device, params))
