"""What the serving checks share: a backend run through the serving harness (kda_kernels.serving) with its
time counted as the backend's, and how a served run is compared and inspected."""

from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import assume
from hypothesis import strategies as st

from kda_cases.case import Case
from kda_cases.dtypes import bits
from kda_cases.guards import memory_of
from kda_cases.materialize import KDAInputs
from kda_cases.profiles import Profile
from kda_conformance.checks._registry import draw_case, supported
from kda_conformance.judging.judge import Judge
from kda_conformance.running.stages import CLOCK
from kda_conformance.running.truth import inputs_truth
from kda_kernels import serving as harness
from kda_kernels.protocol import Backend, BackendOutput, WorkingPrecision
from kda_kernels.serving import NULL_SLOT, PoolPlan, ServingRun, outside
from kda_reports.findings import Finding, Location

REGIONS = ("null", "fresh", "checkpoint", "spare", "tail")


def serving_case(case: Case, backend: Backend) -> Case:
    """The case a server would see: packed (``cu_seqlens``), with checkpoints only for a backend that
    returns checkpoint states."""
    served = case if case.packed else case.replace(packed=True)
    return served if backend.produces_checkpoints else served.replace(checkpoints=())


def run_serving(backend: Backend, inputs: KDAInputs, *args, **kwargs) -> ServingRun:
    """The harness's ``run_serving``, its time counted as the backend's (running.stages)."""
    with CLOCK.stage("backend", inputs.device):
        return harness.run_serving(backend, inputs, *args, **kwargs)


def serve(backend: Backend, inputs: KDAInputs, *args, **kwargs) -> None:
    """The harness's ``serve``, its time counted as the backend's (running.stages)."""
    with CLOCK.stage("backend", inputs.device):
        harness.serve(backend, inputs, *args, **kwargs)


def served_result(run: ServingRun) -> BackendOutput:
    return BackendOutput(o=run.o, final_state=run.final_states, checkpoint_states=run.checkpoint_states)


def first_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[int, ...] | None:
    differs = bits(a) != bits(b)
    return tuple(differs.nonzero()[0].tolist()) if differs.any() else None


def token_location(case: Case, position: int, head: int) -> tuple[str, Location]:
    """Where packed row position ``position`` lies (sequence and token, or past the last token): as words
    and as a location."""
    for n, (_, start, end) in enumerate(case.row_spans):
        if start <= position < end:
            return f"seq {n} token {position - start}", Location(sequence=n, token=position - start, head=head)
    words = f"row position {position} (past the last token, {case.total_tokens})"
    return words, Location(position=position, head=head)


def slot_owner(plan: PoolPlan, slot: int) -> str:
    if slot == NULL_SLOT:
        return "the null slot 0"
    if slot in plan.seq_slots:
        return f"slot {slot} (sequence {plan.seq_slots.index(slot)}'s state)"
    if slot in plan.checkpoint_slots:
        return f"slot {slot} (checkpoint {plan.checkpoint_slots.index(slot)})"
    return f"slot {slot} (spare: no sequence names it)"


def outside_changes(view: torch.Tensor, before: torch.Tensor | None) -> int | None:
    """The first element of the memory ``view`` lies in, not ``view``'s own, whose bits changed since ``before``
    (that memory as it was): a write into a padded pool's gaps, or the caller's buffer around its slice."""
    if before is None:
        return None
    changed = (bits(memory_of(view)) != bits(before)) & outside(view)
    return int(changed.nonzero()[0]) if bool(changed.any()) else None


def integrity(judge: Judge, run: ServingRun, which: str) -> list[Finding]:
    """Slots nobody names (slot 0 included), output rows past the tokens, the gaps between a padded pool's slots
    and the caller's buffer around its output slice must come back bitwise unchanged."""
    findings = []
    at = outside_changes(run.pool, run.pool_memory_before)
    if at is not None:
        stride, slot = run.pool.stride(0), run.pool[0].numel()
        after, element = at // stride, at % stride - slot
        text = (
            f"the pool's padding between slots was written: element {element} of the {stride - slot}-element gap "
            f"after slot {after} (a page padded past its slot: the kernel addresses slots by the pool's own stride)"
        )
        findings.append(judge.problem(f"{which}: pool padding", text, Location(slot=after)))
    at = outside_changes(run.out, run.out_memory_before)
    if at is not None:
        row = at // run.out[0, 0].numel() - run.plan.out_offset
        side = "before" if row < 0 else "after"
        text = (
            f"the caller's buffer was written outside the output slice it was handed: row {row} of the slice, "
            f"{side} it (the slice starts {run.plan.out_offset} rows into a larger buffer; those rows are another "
            "batch's)"
        )
        findings.append(judge.problem(f"{which}: output buffer", text, Location(position=row), "o"))
    for slot in run.plan.unnamed_slots:
        where = first_difference(run.pool[slot], run.pool_before[slot])
        if where is not None:
            text = f"{slot_owner(run.plan, slot)} was written (first at head {where[0]})"
            findings.append(judge.problem(f"{which}: slot {slot}", text, Location(slot=slot, head=where[0])))
    T = run.inputs.case.total_tokens
    where = first_difference(run.out[:, T:], run.out_before[:, T:])
    if where is not None:
        words, location = token_location(run.inputs.case, T + where[1], where[2])
        text = f"output {words} was written (head {where[2]}): not a token"
        findings.append(judge.problem(f"{which}: output tail", text, location, "o"))
    return findings


def differences(judge: Judge, got: ServingRun, want: ServingRun, what: str) -> list[Finding]:
    """Where ``got`` (a poisoned run) differs from ``want`` (the clean run): output rows and named slots."""
    case, findings = got.inputs.case, []
    T = case.total_tokens
    where = first_difference(got.out[:, :T], want.out[:, :T])
    if where is not None:
        words, location = token_location(case, where[1], where[2])
        text = f"output differs {what}, first at {words} head {where[2]}"
        findings.append(judge.problem("output", text, location, "o"))
    for slot in sorted(got.plan.named_slots):
        where = first_difference(got.pool[slot], want.pool[slot])
        if where is not None:
            text = f"{slot_owner(got.plan, slot)} differs {what} (first at head {where[0]})"
            findings.append(judge.problem(f"slot {slot}", text, Location(slot=slot, head=where[0])))
    return findings


def request_findings(
    judge: Judge, what: str, request: KDAInputs, got: BackendOutput, precision: WorkingPrecision | None = None
) -> list[Finding]:
    """A request judged as a case of its own: the float64 truth of exactly what it was given (its initial
    state as the pool stored it: a bf16 pool's rounding is the server's choice), budgets from the baseline
    on the same request (at the backend's declared working precision, the batch's truth's). Its findings name
    the request's case; they carry the check's repro line."""
    truth = inputs_truth(request, precision=precision)
    request_judge = Judge(judge.check, request.case, judge.backend, judge.device, judge.repro)
    return request_judge.result(truth.reference, got, truth.budgets, what)


def draw_served(
    data: st.DataObject, profile: Profile, backend: Backend, wanted: Callable[[Case], bool] | None = None
) -> Case:
    """A case as a server would send it to ``backend``, that ``wanted`` accepts and the backend takes."""
    case = draw_case(data, profile, backend, serving_case)
    if wanted is not None:
        assume(wanted(case))
    supported(backend, case)
    return case
