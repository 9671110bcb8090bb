"""Backend calls under the guard, and whose fault a failure is: a backend that raises, breaks its call
contract, runs out of memory or kills its device context gives a finding that says so (``skip``, ``error``,
``resource``, with the reason and where it raised) instead of stopping the run."""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable

import torch

from kda_cases.case import Case
from kda_cases.materialize import KDAInputs
from kda_conformance.judging.judge import Judge, judge_for
from kda_conformance.judging.tolerance import InvalidTruth
from kda_conformance.running.faults import is_out_of_memory, is_sticky, memory_report
from kda_conformance.running.memory import release_quietly
from kda_conformance.running.stages import CLOCK, stage_of
from kda_kernels import guard
from kda_kernels.guard import TOKEN_INPUTS, BackendFault, exception_text, raised_by, run_backend_call
from kda_kernels.protocol import Backend, BackendOutput, Unsupported
from kda_reports.findings import SUITE_BACKEND, Finding, Location

# What a finding about the call contract (kernels/guard.py) compared.
CONTRACT = "the call contract (inputs unchanged, outputs its own)"


def call_backend(backend: Backend, inputs: KDAInputs) -> BackendOutput:
    """``backend.run(inputs)`` under the call contract (kernels/guard.py), its time counted as the
    backend's stage (synchronized on GPUs)."""
    with CLOCK.stage("backend", inputs.device):
        return run_backend_call(backend, inputs)


def fault_finding(judge: Judge, fault: BackendFault, seconds: float = 0.0) -> Finding:
    """A broken call contract as the backend's finding: a failure that points at the memory it wrote or
    shared, or an error where it gave no output."""
    if fault.verdict == "error":
        return judge.outcome("error", fault.reason, seconds)
    where = _location(judge.case, fault)
    tensor = fault.tensor if fault.tensor in ("o", "final_state", "checkpoint_states") else ""
    return judge.problem(CONTRACT, fault.reason, where, tensor)


def _location(case: Case, fault: BackendFault) -> Location | None:
    """Where a contract fault points: a pool slot, a token of a token tensor, a sequence's initial state."""
    index = fault.index or ()
    if fault.slot is not None:
        return Location(slot=fault.slot)
    if fault.tensor in TOKEN_INPUTS and len(index) >= 3:
        row, position, head = index[:3]
        if case.packed:
            for n, (_, start, end) in enumerate(case.row_spans):
                if start <= position < end:
                    return Location(sequence=n, token=position - start, head=head)
        return Location(row=row, token=position, head=head)
    if fault.tensor == "initial_state" and len(index) >= 2:
        return Location(sequence=index[0], head=index[1])
    return None


# How a finding says the check did not apply to its case (a NotApplicable raised by the check): a drawn example
# the pytest test rejects (Hypothesis draws another), where a fixed case's skip is the caller's to read.
NOT_APPLICABLE = "check does not apply"


class NotApplicable(ValueError):
    """A check cannot run on this case (a split point outside the sequence, a two-step prefill of one-token
    sequences): a skip of the check with the reason, never anyone's error."""


def blame(judge: Judge, exc: Exception, device: torch.device) -> Finding:
    """Whose fault an exception from a check is: the machine's (out of memory, in any stage), the backend's
    (its own code raised, it broke the call contract, or a sticky device error), or the suite's (its own
    code raised, or the baseline did), named with the stage it was raised in."""
    backend = judge.backend
    stage = stage_of(exc) or "check"
    culprit = raised_by(exc)
    if is_out_of_memory(exc, device):
        return judge.outcome("resource", f"{memory_report(exc, device)} (in the {stage} stage)")
    if isinstance(exc, BackendFault) and culprit == backend:
        return fault_finding(judge, exc)
    if culprit == backend or is_sticky(exc):
        return judge.outcome("error", raised_at(exc))
    who = f"the baseline {culprit}" if culprit else "the suite's own code"
    reason = f"{who} raised in the {stage} stage (not {backend}'s error): {raised_at(exc)}"
    release_quietly(device)
    return dataclasses.replace(judge.outcome("error", reason), backend=SUITE_BACKEND)


def blamed(judge: Judge, device: torch.device, run: Callable[[], list[Finding]]) -> list[Finding]:
    """``run()``'s findings; where it raises, one finding that charges the exception to whoever caused it
    (:func:`blame`; a case whose truth cannot be judged is the suite's)."""
    guard.take_breaches()  # another check's, already taken or lost with it
    try:
        findings = run()
    except NotApplicable as exc:
        skipped = judge.outcome("skip", f"check {judge.check} does not apply: {exc}")
        findings = [dataclasses.replace(skipped, observed=NOT_APPLICABLE)]
    except Unsupported as exc:
        findings = [judge.outcome("skip", str(exc))]
    except InvalidTruth as exc:  # the case's fault, not the backend's: recorded under the suite
        release_quietly(device)
        reason = f"invalid case (not {judge.backend}'s error): {exc}"
        findings = [dataclasses.replace(judge.outcome("error", reason), backend=SUITE_BACKEND)]
    except Exception as exc:
        findings = [blame(judge, exc, device)]
    return findings + breach_findings(judge, findings)


def breach_findings(judge: Judge, findings: list[Finding]) -> list[Finding]:
    """The contract breaks the calls of a check survived (kernels/guard.py), as findings: the backend's, or
    the suite's where its baseline broke them, or, where a thread another backend left running did it after
    its call (a late breach), that backend's, on this case; a pool slot the check's own findings already
    point at is not said twice."""
    pointed = {f.first_bad.slot for f in findings if f.first_bad is not None and f.first_bad.slot is not None}
    said: set[str] = set()
    extra = []
    for breach in guard.take_breaches():
        if breach.slot in pointed or breach.reason in said:
            continue
        said.add(breach.reason)
        finding = fault_finding(judge, breach)
        owner = raised_by(breach)
        if breach.late and owner is not None and owner != judge.backend:
            finding = fault_finding(judge_for(judge.check, judge.case, owner, torch.device(judge.device)), breach)
        elif owner != judge.backend:
            reason = f"the baseline broke the call contract (not {judge.backend}'s error): {breach.reason}"
            finding = dataclasses.replace(judge.outcome("error", reason), backend=SUITE_BACKEND)
        extra.append(finding)
    return extra


def raised_at(exc: BaseException) -> str:
    """``Type: message (at file:line)``: an exception as a finding's reason, with the line that raised it and
    the notes added on its way up (a check says what it had set when the device was lost)."""
    last = traceback.extract_tb(exc.__traceback__)[-1]
    notes = "".join(f"; {note}" for note in getattr(exc, "__notes__", ()) if isinstance(note, str))
    return f"{type(exc).__name__}: {exception_text(exc)} (at {last.filename.rsplit('/', 1)[-1]}:{last.lineno}){notes}"
