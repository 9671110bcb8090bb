"""The budget check: output, final state and checkpoint states of a case within the case's budgets; the
check every other check builds on, and the one the sweep, the corpus, the long cases and the sentinels run.

A backend that is unavailable, does not take the case, or raises gives a finding that says so (``skip`` or
``error``, with the reason and where it raised) instead of stopping the run."""

from __future__ import annotations

from collections.abc import Mapping

from hypothesis import strategies as st

from kda_cases.profiles import Profile
from kda_conformance.checks._check import Check
from kda_conformance.checks._registry import draw_case, supported
from kda_conformance.judging.judge import Judge
from kda_conformance.judging.repro import BUDGET_CHECK
from kda_conformance.running.blame import fault_finding, raised_at
from kda_conformance.running.faults import is_out_of_memory, memory_report
from kda_conformance.running.runnable import Drawn
from kda_conformance.running.stages import CLOCK, Lap
from kda_conformance.running.truth import CaseTruth
from kda_kernels import guard
from kda_kernels.guard import BackendFault, run_backend_call
from kda_kernels.protocol import Backend, Unsupported
from kda_reports.findings import Finding


def draw(data: st.DataObject, profile: Profile, backend: Backend) -> Drawn:
    case = draw_case(data, profile, backend)
    supported(backend, case)
    return Drawn(case)


def run(truth: CaseTruth, backend: Backend, params: Mapping[str, object], judge: Judge) -> list[Finding]:
    """``backend`` on the case, every tensor it returns held to the case's budgets."""
    case, inputs = truth.case, truth.inputs
    device = inputs.device
    try:
        available = guard.availability(backend, device)
        supported = guard.supports(backend, case) if available else available
    except BackendFault as fault:
        return [fault_finding(judge, fault)]
    if not supported:
        return [judge.outcome("skip", supported.reason)]
    lap = Lap()  # where the stage's own synchronize raises (an earlier kernel's fault), the lap stays empty
    try:
        with CLOCK.stage("backend", device) as lap:
            result = run_backend_call(backend, inputs)
    except Unsupported as exc:
        return [judge.outcome("skip", str(exc))]
    except BackendFault as fault:
        return [fault_finding(judge, fault, lap.seconds)]
    except Exception as exc:  # a kernel failure is a result to record, not a crash of the sweep
        if is_out_of_memory(exc, device):
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


CHECK = Check(
    name=BUDGET_CHECK,
    title="budget",
    suite="properties",
    test_name="test_within_budget",
    summary="Output, final state and checkpoint states of every drawn case within the case's budgets.",
    draw=draw,
    run=run,
    ci_seed=0x779A24424EFC5E695FBB1EBB58EC52B65AAC3A3F3FABC622FC6A653A972CCD950C856D99BC0FA757A5C111461F04784D,
    targets=True,
)
