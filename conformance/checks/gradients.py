"""Gradients: a backend's backward pass on a case, each gradient (of q, k, v, g, beta, the initial state, and
A_log and dt_bias where the gate is computed in the kernel) held to the float64 gradients within budgets set by
the working-precision baseline's backward (docs/tolerance.md, "Gradients"), the first bad (sequence, token,
head) named per gradient. Then, against the same float64 gradients and budgets: a packed case's sequences each
alone, and a [B, T] case split in half, its second half resumed from the first's final state (held in fp32,
as the forward's split check holds it) and the gradient passed back through that state (dh0 of the second half
as the first half's final-state gradient).
The backward then runs twice more: again (the same bits, or a nondeterminism warning) and with its
``torch.empty`` scratch poisoned (the same bits, or a failure: it read memory nobody wrote).

The upstream gradients are drawn with the case (cases/seeded.py ``upstream``): ``d_o`` of the outputs and
``d_final`` of the final states. A backend takes part where its envelope declares a backward pass
(``Envelope.backward``) and it defines ``run_backward``; FLA's chunk kernels do. Checkpoint states have no
gradient (a training step does not cache prefixes), so the check's cases have none."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from hypothesis import strategies as st

from kda_cases.case import Case
from kda_cases.dtypes import GRADIENT_TENSORS, PARAMETER_GRADIENTS, stored_dtype
from kda_cases.materialize import KDAInputs
from kda_cases.profiles import Profile
from kda_conformance.checks._check import Check
from kda_conformance.checks._derived import alone_inputs, split_inputs, token_slice
from kda_conformance.checks._registry import draw_case, supported
from kda_conformance.checks.determinism import largest_change
from kda_conformance.judging.judge import Judge
from kda_conformance.judging.metrics import measure
from kda_conformance.running.blame import NotApplicable, call_backend, raised_at
from kda_conformance.running.faults import is_out_of_memory, memory_report
from kda_conformance.running.gradient_truth import (
    TOKEN_GRADIENTS,
    GradientTruth,
    alone_sequences,
    by_tensor,
    gradient_truth,
    part_scale,
    sequence_part,
)
from kda_conformance.running.runnable import Drawn
from kda_conformance.running.stages import CLOCK, Lap
from kda_conformance.running.truth import CaseTruth
from kda_kernels.protocol import Backend, Unsupported
from kda_kernels.serving import poisoned_scratch
from kda_reports.findings import Finding

NAME = "gradients"
# The subject of the records of the whole case's backward (the others: its sequences alone, its halves).
WHOLE_BACKWARD = "backward"
# What fills the backward's uninitialised scratch in the poisoned run.
SCRATCH_POISON = "nan"


def declares_backward(backend: Backend) -> str | None:
    """Why the check does not apply: the backend declares no backward pass."""
    if backend.envelope.backward and backend.run_backward is not None:
        return None
    return f"{backend.name} declares no backward pass (its envelope's backward is False)"


def prepare(case: Case, backend: Backend) -> Case:
    """Without checkpoints: their states have no gradient."""
    return case.replace(checkpoints=()) if case.checkpoints else case


def draw(data: st.DataObject, profile: Profile, backend: Backend) -> Drawn:
    case = draw_case(data, profile, backend, prepare)
    supported(backend, case)
    return Drawn(case)


def run(truth: CaseTruth, backend: Backend, params: Mapping[str, object], judge: Judge) -> list[Finding]:
    inputs = truth.inputs
    grads = gradient_truth(inputs, precision=truth.precision)
    assert backend.run_backward is not None  # the check applies only where it is defined
    lap = Lap()
    try:
        with CLOCK.stage("backend", inputs.device) as lap:
            got = by_tensor(backend.run_backward(inputs, grads.d_o, grads.d_final))
    except Unsupported as exc:  # a case its backward does not take: another is drawn (a fixed one is a skip)
        raise NotApplicable(str(exc)) from None
    except Exception as exc:  # a backward that fails is a result to record, not a crash of the sweep
        if is_out_of_memory(exc, inputs.device):
            return [judge.outcome("resource", memory_report(exc, inputs.device), lap.seconds)]
        return [judge.outcome("error", raised_at(exc), lap.seconds)]
    findings = [_verdict(judge, grads, name, got.get(name), WHOLE_BACKWARD) for name in grads.reference]
    findings += _packed_against_alone(backend, inputs, grads, judge)
    findings += _resumed_against_whole(backend, inputs, grads, judge)
    return findings + _repeated(backend, inputs, grads, got, judge)


def _verdict(
    judge: Judge,
    grads: GradientTruth,
    name: str,
    got: torch.Tensor | None,
    subject: str,
    want: torch.Tensor | None = None,
    alone: int | None = None,
) -> Finding:
    """``got`` held to gradient ``name``'s budget against the float64 gradient (``want``: the rows of it that
    ``got`` covers; ``alone``: the sequence they are, run by itself, held to that sequence's budgets), its
    rel-RMS relative to the gradient's scale; for rows, to the scale their budget was set on (``part_scale``)."""
    whole = grads.reference[name]
    if want is None:
        measured = measure(name, got, whole, grads.scales.get(name, (0.0, 0.0))[1])
    else:
        measured = measure(name, got, want, part_scale(grads.reference, grads.scales, name))
    budget = grads.budgets[name] if alone is None else grads.sequence_budgets[alone][name]
    return judge.verdict(measured, budget, None if got is None else got.dtype, subject, alone)


def _packed_against_alone(backend: Backend, inputs: KDAInputs, grads: GradientTruth, judge: Judge) -> list[Finding]:
    """A packed case: each of its ``alone_sequences`` (the first and the last non-empty ones) run alone, its
    gradients held to its part of the float64 gradients, within that part's budgets (the parameters'
    gradients, sums over every sequence, are not split)."""
    assert backend.run_backward is not None
    findings = []
    for n, span in alone_sequences(inputs.case):
        row, start, end = span
        d_final = grads.d_final[n : n + 1]
        alone = by_tensor(backend.run_backward(alone_inputs(inputs, n), grads.d_o[row : row + 1, start:end], d_final))
        for name, want in sequence_part(grads.reference, n, span).items():
            findings.append(_verdict(judge, grads, name, alone.get(name), f"sequence {n} {name} alone", want, n))
    return findings


def _resumed_against_whole(backend: Backend, inputs: KDAInputs, grads: GradientTruth, judge: Judge) -> list[Finding]:
    """A [B, T] case of two tokens or more, split in half: the second half resumed from the first half's final
    state (the backend's forward), its backward taken, and the first half's backward taken with the second
    half's initial-state gradient as its final-state gradient: the halves' gradients (the parameters' as their
    sum) within the budgets of the whole run's float64 gradients. What a backward through dh0 between two
    calls (context parallelism, a split long sequence) must give."""
    case = inputs.case
    if case.packed or case.seq_lens[0] < 2:
        return []
    assert backend.run_backward is not None
    dh0_dtype = stored_dtype(case, "dh0")  # the case's state dtype, as the whole run hands dh0 back
    if case.state_dtype != "fp32":
        # The state between the halves in fp32, as the forward's split check holds it (split_resume.splittable):
        # a bf16 state rounds the state and its gradient at the split, a cost the whole run's budgets leave out
        # (the baseline's own backward went 1.3 to 1.8 times past them on T32+32+32 fp16 H8 K256, bf16 state).
        case = case.replace(state_dtype="fp32")
        h0 = inputs.initial_state
        inputs = dataclasses.replace(inputs, case=case, initial_state=None if h0 is None else h0.float())
    T = case.seq_lens[0]
    p = T // 2
    prefix, suffix_case = split_inputs(inputs, p)
    state = call_backend(backend, prefix).final_state
    if state is None:
        return []
    suffix = token_slice(inputs, p, T, state, suffix_case.replace(initial_state="random"))
    later = by_tensor(backend.run_backward(suffix, grads.d_o[:, p:], grads.d_final))
    earlier = by_tensor(backend.run_backward(prefix, grads.d_o[:, :p], later["dh0"]))
    halves = {name: torch.cat([earlier[name], later[name]], dim=1) for name in TOKEN_GRADIENTS}
    halves.update({name: earlier[name] + later[name] for name in PARAMETER_GRADIENTS if name in later})
    if "dh0" in grads.reference:
        halves["dh0"] = earlier["dh0"].to(dh0_dtype)
    return [_verdict(judge, grads, name, half, f"{name} resumed at token {p}") for name, half in halves.items()]


def _changes(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: largest_change(first[name], second[name]) for name in first if name in second}


def _repeated(
    backend: Backend, inputs: KDAInputs, grads: GradientTruth, got: dict[str, torch.Tensor], judge: Judge
) -> list[Finding]:
    """The same backward run again (its gradients the same bits, else a nondeterminism warning with each
    gradient's change beside its limit), then under poisoned scratch (``torch.empty`` of its backward filled
    with NaN, and on CUDA the allocator's blocks): a gradient that moves read memory nobody wrote.

    A backward that varies by itself is still run with poisoned scratch, its gradients then held to the float64
    ones and their budgets (as the poison check holds a served batch that varies): a bitwise change would say
    nothing of what it read, and one that reads stale memory varies from run to run for that very reason."""
    assert backend.run_backward is not None
    again = by_tensor(backend.run_backward(inputs, grads.d_o, grads.d_final))
    varied = {name: change for name, change in _changes(got, again).items() if change}
    with poisoned_scratch(inputs.device, SCRATCH_POISON):
        poisoned = by_tensor(backend.run_backward(inputs, grads.d_o, grads.d_final))
    subject = "backward with poisoned scratch"
    if varied:
        words = ", ".join(
            f"{name} by max-abs {change:.3e} ({change / grads.budgets[name].max_abs.value:.3g} of its limit)"
            for name, change in varied.items()
        )
        said = judge.passed("the same backward, run twice")
        reason = f"gradients differ: {words}; the {subject} judged against the float64 gradients"
        judged = [_verdict(judge, grads, name, poisoned.get(name), subject) for name in grads.reference]
        return [dataclasses.replace(said, verdict="warn", observed="nondeterministic", reason=reason), *judged]
    moved = {name: change for name, change in _changes(got, poisoned).items() if change}
    if moved:
        words = ", ".join(f"{name} by max-abs {change:.3e}" for name, change in moved.items())
        return [judge.problem(subject, f"NaN in torch.empty scratch moved {words}")]
    return [dataclasses.replace(judge.passed("the same backward twice, and with poisoned scratch"), observed="equal")]


CHECK = Check(
    name=NAME,
    title="gradients",
    suite="properties",
    test_name="test_gradients_within_budget",
    summary="A backend's backward pass: the gradients of "
    + ", ".join(GRADIENT_TENSORS)
    + " for drawn upstream gradients, each within its budget against the float64 gradients (the baseline's "
    "backward sets them), the first bad (sequence, token, head) named; the same bits again and with poisoned "
    "scratch (held to the float64 gradients where it varies by itself).",
    draw=draw,
    run=run,
    ci_seed=0x6772616469656E7473,
    prepare=prepare,
    requires=declares_backward,
    # Each example is a dozen backward passes (the truth, the baseline at three chunk sizes, the backend's own
    # four ways and twice more): eight per backend, whatever the profile gives the others.
    max_examples=8,
)
