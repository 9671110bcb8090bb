"""Checks of a backend run through the serving harness (kda_kernels.serving): poisoned memory, slots, steps.

Each check returns a list of findings (empty: passed), each a message that says where the run went wrong
(sequence, token, head; which slot was written, or read, that should not have been); the tests print them
with the ``kda-conformance repro`` line that rebuilds the case (``repro_line``).
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable

import torch

from kda_cases.case import Case
from kda_cases.materialize import KDAInputs
from kda_conformance.properties import TOKEN_TENSORS
from kda_conformance.stages import CLOCK
from kda_conformance.sweep import CaseTruth, case_truth, inputs_truth, judge_result
from kda_conformance.tolerance import TensorVerdict
from kda_kernels import serving as harness
from kda_kernels.protocol import Backend, BackendOutput
from kda_kernels.serving import (
    NULL_SLOT,
    PoolPlan,
    ServingRun,
    bits,
    build_pool,
    new_out,
    plan_pool,
    poisoned_scratch,
)

REGIONS = ("null", "fresh", "checkpoint", "spare", "tail")


def run_serving(backend: Backend, inputs: KDAInputs, *args, **kwargs) -> ServingRun:  # type: ignore[no-untyped-def]
    """The harness's ``run_serving``, its time counted as the backend's (conformance.stages)."""
    with CLOCK.stage("backend", inputs.device):
        return harness.run_serving(backend, inputs, *args, **kwargs)


def serve(backend: Backend, inputs: KDAInputs, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
    """The harness's ``serve``, its time counted as the backend's (conformance.stages)."""
    with CLOCK.stage("backend", inputs.device):
        harness.serve(backend, inputs, *args, **kwargs)


def serving_case(case: Case, backend: Backend) -> Case:
    """The case a server would see: packed (``cu_seqlens``), with checkpoints only for a backend that
    returns checkpoint states."""
    served = case if case.packed else case.replace(packed=True)
    return served if backend.produces_checkpoints else served.replace(checkpoints=())


def repro_line(case: Case, backend: str, device: torch.device, poison: str, check: str = "poison") -> str:
    return (
        f"kda-conformance repro --device {device.type} --backend {backend} --poison {poison} --check {check} "
        f"--case {shlex.quote(case.to_json())}"
    )


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[int, ...] | None:
    differs = bits(a) != bits(b)
    return tuple(differs.nonzero()[0].tolist()) if differs.any() else None


def _token(case: Case, position: int) -> str:
    """Where packed row position ``position`` lies: sequence and token, or past the last token."""
    for n, (_, start, end) in enumerate(case.row_spans):
        if start <= position < end:
            return f"seq {n} token {position - start}"
    return f"row position {position} (past the last token, {case.total_tokens})"


def _slot_owner(plan: PoolPlan, slot: int) -> str:
    if slot == NULL_SLOT:
        return "the null slot 0"
    if slot in plan.seq_slots:
        return f"slot {slot} (sequence {plan.seq_slots.index(slot)}'s state)"
    if slot in plan.checkpoint_slots:
        return f"slot {slot} (checkpoint {plan.checkpoint_slots.index(slot)})"
    return f"slot {slot} (spare: no sequence names it)"


def integrity_findings(run: ServingRun) -> list[str]:
    """Slots nobody names (slot 0 included) and output rows past the tokens must come back bitwise unchanged."""
    findings = []
    for slot in run.plan.unnamed_slots:
        where = _first_difference(run.pool[slot], run.pool_before[slot])
        if where is not None:
            findings.append(f"{_slot_owner(run.plan, slot)} was written (first at head {where[0]})")
    T = run.inputs.case.total_tokens
    where = _first_difference(run.out[:, T:], run.out_before[:, T:])
    if where is not None:
        findings.append(f"output {_token(run.inputs.case, T + where[1])} was written (head {where[2]}): not a token")
    return findings


def difference_findings(got: ServingRun, want: ServingRun, what: str) -> list[str]:
    """Where ``got`` (a poisoned run) differs from ``want`` (the clean run): output rows and named slots."""
    case, findings = got.inputs.case, []
    T = case.total_tokens
    where = _first_difference(got.out[:, :T], want.out[:, :T])
    if where is not None:
        findings.append(f"output differs {what}, first at {_token(case, where[1])} head {where[2]}")
    for slot in sorted(got.plan.named_slots):
        where = _first_difference(got.pool[slot], want.pool[slot])
        if where is not None:
            findings.append(f"{_slot_owner(got.plan, slot)} differs {what} (first at head {where[0]})")
    return findings


def _problems(verdict: TensorVerdict) -> str:
    return "; ".join(verdict.problems) + f" (first bad: {verdict.first_bad or '-'})"


def served_result(run: ServingRun) -> BackendOutput:
    return BackendOutput(o=run.o, final_state=run.final_states, checkpoint_states=run.checkpoint_states)


def poison_findings(truth: CaseTruth, backend: Backend, poison: str) -> list[str]:
    """The clean run within budget; the poisoned run (pool, output buffer, scratch) bitwise equal to it;
    nothing written where nothing may be. A difference is traced to the region the backend read."""
    case, inputs = truth.case, truth.inputs
    plan = plan_pool(case)
    clean = run_serving(backend, inputs, plan, "none")
    findings = [
        f"{case.id} ({case.label}) backend {backend.name} tensor {v.error.tensor}: {_problems(v)}"
        for v in judge_result(truth, served_result(clean))
        if not v.passed
    ]
    findings += integrity_findings(clean)
    with poisoned_scratch(inputs.device, poison):
        poisoned = run_serving(backend, inputs, plan, poison)
    findings += integrity_findings(poisoned)
    differences = difference_findings(poisoned, clean, f"with {poison} poison")
    if differences:
        read = [r for r in REGIONS if difference_findings(run_serving(backend, inputs, plan, poison, (r,)), clean, "")]
        with poisoned_scratch(inputs.device, poison):
            scratch = run_serving(backend, inputs, plan, "none")
        read += ["scratch (torch.empty)"] if difference_findings(scratch, clean, "") else []
        differences.append("poison reached the result from: " + (", ".join(read) or "no single region"))
    return findings + differences


def step_inputs(inputs: KDAInputs, spans: list[tuple[int, int]]) -> KDAInputs:
    """The tokens ``spans`` (packed row positions) of a packed batch, as a packed batch of their own."""
    case = inputs.case
    pieces = {name: torch.cat([getattr(inputs, name)[:, a:b] for a, b in spans], dim=1) for name in TOKEN_TENSORS}
    step = case.replace(seq_lens=tuple(b - a for a, b in spans), checkpoints=())
    cu = torch.tensor(step.offsets, dtype=torch.int32, device=inputs.device)
    return dataclasses.replace(inputs, case=step, cu_seqlens=cu, **pieces)


def _request_findings(what: str, request: KDAInputs, got: BackendOutput) -> list[str]:
    """A request judged as a case of its own: the float64 truth of exactly what it was given (its initial
    state as the pool stored it: a bf16 pool's rounding is the server's choice), budgets from the baseline
    on the same request."""
    truth = inputs_truth(request)
    return [f"{what}: {v.error.tensor}: {_problems(v)}" for v in judge_result(truth, got) if not v.passed]


def steps_findings(truth: CaseTruth, backend: Backend) -> list[str]:
    """Chunked prefill across two steps: every sequence's first half written to its slot in step 1, the
    rest resumed from that slot in step 2; each step judged as a request of its own."""
    case, inputs = truth.case, truth.inputs
    if case.max_len < 2:
        raise ValueError(f"a two-step prefill needs a sequence of 2 tokens or more; {case.id} has {case.seq_lens}")
    plan = plan_pool(case.replace(checkpoints=()))
    spans = [(start, end) for _, start, end in case.row_spans]
    cuts = [start + (end - start) // 2 for start, end in spans]
    first = step_inputs(inputs, [(s, c) for (s, _), c in zip(spans, cuts, strict=True)])
    second = step_inputs(inputs, [(c, e) for (_, e), c in zip(spans, cuts, strict=True)])
    pool = build_pool(dataclasses.replace(inputs, case=case.replace(checkpoints=())), plan, "nan")
    out1, out2 = new_out(first.case, plan, "nan", inputs.device), new_out(second.case, plan, "nan", inputs.device)
    slots = list(plan.seq_slots)
    serve(backend, first, pool, plan.seq_slots, (case.has_initial_state,) * case.num_seqs, out1, padding=plan.padding)
    after_first = pool[slots].clone()
    resumed = tuple(case.has_initial_state or c > s for (s, _), c in zip(spans, cuts, strict=True))
    serve(backend, second, pool, plan.seq_slots, resumed, out2, padding=plan.padding)
    keep = torch.tensor(resumed, device=inputs.device).view(-1, 1, 1, 1)
    stored = torch.where(keep, after_first, torch.zeros_like(after_first))
    T1, T2 = first.case.total_tokens, second.case.total_tokens
    return _request_findings(
        "two-step prefill, step 1 (first half of each sequence)",
        first,
        BackendOutput(o=out1[:, :T1], final_state=after_first),
    ) + _request_findings(
        "two-step prefill, step 2 (the rest, resumed from the slots)",
        dataclasses.replace(second, initial_state=stored),
        BackendOutput(o=out2[:, :T2], final_state=pool[slots]),
    )


def checkpoint_resume_findings(truth: CaseTruth, backend: Backend) -> list[str]:
    """Each checkpoint written to its slot by the batch (against the truth, within budget), then resumed by
    a later request (the rest of its sequence, reading that slot), judged as a request of its own."""
    case, inputs = truth.case, truth.inputs
    plan = plan_pool(case)
    run = run_serving(backend, inputs, plan, "nan")
    findings = [
        f"checkpoint slots after the batch: {_problems(v)}"
        for v in judge_result(truth, served_result(run))
        if v.error.tensor == "checkpoint_states" and not v.passed
    ]
    for j, ((seq, position), slot) in enumerate(zip(case.checkpoints, plan.checkpoint_slots, strict=True)):
        _, start, end = case.row_spans[seq]
        if start + position == end:
            continue  # nothing left to resume
        later = step_inputs(inputs, [(start + position, end)])
        pool = run.pool.clone()
        out = new_out(later.case, plan, "nan", inputs.device)
        serve(backend, later, pool, (slot,), (True,), out)
        findings += _request_findings(
            f"request resumed from checkpoint {j} (slot {slot}, sequence {seq} at token {position})",
            dataclasses.replace(later, initial_state=run.pool[[slot]]),
            BackendOutput(o=out[:, : end - start - position], final_state=pool[[slot]]),
        )
    return findings


def resplit(case: Case) -> Case:
    """The same tokens cut into sequences differently: what a reused ``cu_seqlens`` tensor is given next."""
    T = case.total_tokens
    lens = (T,) if case.num_seqs > 1 else (T - T // 2, T // 2) if T > 1 else (T, 0)
    return case.replace(seq_lens=lens, packed=True, checkpoints=())


def reused_cu_seqlens_findings(truth: CaseTruth, backend: Backend) -> list[str]:
    """One ``cu_seqlens`` tensor object, given a second batch's offsets in place: the second answer must be
    the second batch's (a kernel caching chunk indices on the tensor's identity returns stale bounds)."""
    case, inputs, device = truth.case, truth.inputs, truth.inputs.device
    first_plan = plan_pool(case.replace(checkpoints=()))
    cu = torch.zeros(case.num_seqs + first_plan.padding + 1, dtype=torch.int32, device=device)
    first = dataclasses.replace(inputs, case=case.replace(checkpoints=()))
    pool = build_pool(first, first_plan, "none")
    has_h0 = (case.has_initial_state,) * case.num_seqs
    out = new_out(case, first_plan, "none", device)
    serve(backend, first, pool, first_plan.seq_slots, has_h0, out, padding=first_plan.padding, cu_seqlens=cu)
    other = case_truth(resplit(case), device)
    plan = plan_pool(other.case)
    pool = build_pool(other.inputs, plan, "none")
    out = new_out(other.case, plan, "none", device)
    # The same object, its length kept (padding absorbs the difference in sequence count).
    padding = cu.numel() - 1 - other.case.num_seqs
    has_h0 = (other.case.has_initial_state,) * other.case.num_seqs
    serve(backend, other.inputs, pool, plan.seq_slots, has_h0, out, padding=padding, cu_seqlens=cu)
    result = BackendOutput(o=out[:, : other.case.total_tokens], final_state=pool[list(plan.seq_slots)])
    return [
        f"second batch through the same cu_seqlens tensor ({other.case.seq_lens} after {case.seq_lens}): "
        + _problems(v)
        for v in judge_result(other, result)
        if not v.passed
    ]


# Each check by the name `kda-conformance repro --check` takes; every one gets the poison mode.
SERVING_CHECKS: dict[str, Callable[[CaseTruth, Backend, str], list[str]]] = {
    "poison": poison_findings,
    "steps": lambda truth, backend, poison: steps_findings(truth, backend),
    "checkpoint": lambda truth, backend, poison: checkpoint_resume_findings(truth, backend),
    "cu_seqlens": lambda truth, backend, poison: reused_cu_seqlens_findings(truth, backend),
}
