"""A backend called on a case under a guard, and judged: the budget check every other check builds on.

A backend that is unavailable, does not take the case, or raises gives a finding that says so (``skip`` or
``error``, with the reason and where it raised) instead of stopping the run.
"""

from __future__ import annotations

import traceback

from kda_cases.materialize import KDAInputs
from kda_conformance.judging.judge import judge_for
from kda_conformance.judging.repro import BUDGET_CHECK
from kda_conformance.running.faults import is_out_of_memory, memory_report
from kda_conformance.running.stages import CLOCK, Lap
from kda_conformance.running.truth import CaseTruth
from kda_kernels.protocol import Backend, BackendOutput, Unsupported
from kda_reports.findings import Finding


def call_backend(backend: Backend, inputs: KDAInputs) -> BackendOutput:
    """``backend.run(inputs)``, its time counted as the backend's stage (synchronized on GPUs)."""
    with CLOCK.stage("backend", inputs.device):
        return backend.run(inputs)


def raised_at(exc: BaseException) -> str:
    """``Type: message (at file:line)``: an exception as a finding's reason, with the line that raised it."""
    last = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{type(exc).__name__}: {exc} (at {last.filename.rsplit('/', 1)[-1]}:{last.lineno})"


def run_backend(truth: CaseTruth, backend: Backend) -> list[Finding]:
    """The budget check: ``backend`` on the case, every tensor it returns held to the case's budgets."""
    case, inputs = truth.case, truth.inputs
    device = inputs.device
    judge = judge_for(BUDGET_CHECK, case, backend.name, device)
    available = backend.availability(device)
    if not available:
        return [judge.outcome("skip", available.reason)]
    supported = backend.supports(case)
    if not supported:
        return [judge.outcome("skip", supported.reason)]
    lap = Lap()  # where the stage's own synchronize raises (an earlier kernel's fault), the lap stays empty
    try:
        with CLOCK.stage("backend", device) as lap:
            result = backend.run(inputs)
    except Unsupported as exc:
        return [judge.outcome("skip", str(exc))]
    except Exception as exc:  # a kernel failure is a result to record, not a crash of the sweep
        if is_out_of_memory(exc):
            return [judge.outcome("resource", memory_report(exc, device), lap.seconds)]
        return [judge.outcome("error", raised_at(exc), lap.seconds)]
    with CLOCK.stage("compare", device):
        findings = judge.result(
            truth.reference,
            result,
            truth.budgets,
            seconds=lap.seconds,
            reference_form=truth.reference_form,
            reference_seconds=truth.reference_seconds,
        )
    if case.checkpoints and result.checkpoint_states is None:  # never a silent pass on the checkpoints
        count = f"the case's {len(case.checkpoints)} checkpoint states"
        if backend.produces_checkpoints:
            findings.append(judge.problem("", f"returned none of {count}", tensor="checkpoint_states"))
        else:
            reason = f"{backend.name} returns no checkpoint states: {count} are not compared"
            findings.append(judge.not_compared("checkpoint_states", reason))
    return findings
