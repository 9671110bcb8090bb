"""Padded tails: a server pads a batch's token tensors to a captured graph size, past the last sequence
(``cu_seqlens[-1]`` < the tensors' length). The sequences must still get their right answer, and the output
rows past them must not hold garbage a later operation could read. Reported per backend: ``zero``,
``untouched`` (a caller's buffer left as it was), ``values`` (finite, small), or ``garbage`` (non-finite, or
finite beyond 1e4: the count and the largest value); garbage is a warning, failed under --kda-strict. An
API that allocates its output is called with ``torch.empty`` returning NaN, so a row it leaves unwritten
is garbage in every run, whatever the allocator held."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, cast

import torch
from hypothesis import strategies as st

from kda_cases.materialize import KDAInputs, materialize
from kda_cases.profiles import Profile
from kda_conformance.checks._check import Check
from kda_conformance.checks._derived import TOKEN_TENSORS
from kda_conformance.checks._served import draw_served, run_serving, served_result, serving_case
from kda_conformance.judging.judge import Judge
from kda_conformance.running.blame import call_backend
from kda_conformance.running.runnable import Drawn
from kda_conformance.running.truth import CaseTruth
from kda_kernels.protocol import CALLER_BUFFER_FILL, Backend
from kda_kernels.serving import plan_pool, poisoned_scratch
from kda_reports.findings import Finding

NAME = "padded_tail"
GRAPH_SIZE = 64  # servers capture graphs at a few sizes; the tail runs to the next multiple, plus a chunk's part
GARBAGE = 1e4


def tail_rows(total: int) -> int:
    return (-total) % GRAPH_SIZE + 13


def padded(inputs: KDAInputs) -> KDAInputs:
    """The batch's token tensors padded past the last sequence: with tokens of another draw (what a reused
    graph buffer holds) or, for a case with zero token rows, with zeros (a zero-filled static buffer: SGLang
    zeroes its KDA prefill graph's bucket past the batch); ``cu_seqlens`` and the case unchanged."""
    T = inputs.case.total_tokens
    extra = tail_rows(T)
    other_case = inputs.case.replace(seq_lens=(T + extra,), packed=True, checkpoints=(), seed=inputs.case.seed + 2)
    other = materialize(other_case, inputs.device)
    zeros = inputs.case.zero_tokens != "none"
    tails = {name: getattr(other, name)[:, T:] for name in TOKEN_TENSORS}
    if zeros:
        tails = {name: torch.zeros_like(tail) for name, tail in tails.items()}
    tensors = {name: torch.cat([getattr(inputs, name), tails[name]], dim=1) for name in TOKEN_TENSORS}
    return dataclasses.replace(inputs, **cast(dict[str, Any], tensors))  # the token tensors, by name


def classify(tail: torch.Tensor, before: torch.Tensor | None) -> tuple[str, str]:
    """What the rows past the sequences hold, and the words for it."""
    if before is not None and torch.equal(tail.view(torch.uint8), before.view(torch.uint8)):
        return "untouched", "the caller's buffer left as it was"
    values = tail.double()
    if not bool(values.any()):
        return "zero", "all zero"
    bad = ~values.isfinite() | (values.abs() > GARBAGE)
    if bool(bad.any()):
        finite = values[values.isfinite()].abs()
        largest = float(finite.max()) if finite.numel() else float("nan")
        count = f"{int(bad.sum())} of {values.numel()} values"
        return "garbage", f"{count} non-finite or beyond {GARBAGE:g} (largest finite {largest:.3g})"
    return "values", f"finite values within {GARBAGE:g} (largest {float(values.abs().max()):.3g})"


def draw(data: st.DataObject, profile: Profile, backend: Backend) -> Drawn:
    return Drawn(draw_served(data, profile, backend))


def run(truth: CaseTruth, backend: Backend, params: Mapping[str, object], judge: Judge) -> list[Finding]:
    case, inputs = truth.case, truth.inputs
    T, batch = case.total_tokens, padded(inputs)
    if backend.run_paged is not None:
        # The server's call: the caller's output buffer is as long as the padded tensors.
        plan = dataclasses.replace(plan_pool(case), out_rows=batch.q.shape[1])
        served = run_serving(backend, batch, plan, "sentinel")
        before: torch.Tensor | None = served.out_before[:, T:]  # the caller's rows as handed over
        o, tail = served.o, served.out[:, T:]
        result = served_result(served)
    else:
        # Memory the API allocates and leaves unwritten reads as NaN (as the poison check makes it), so
        # unwritten rows show in every run, not only when the allocator hands out stale memory.
        with poisoned_scratch(inputs.device, "nan"):
            result = call_backend(backend, batch)
        o, tail = result.o[:, :T], result.o[:, T:]
        # An API that writes into the caller's buffer may leave the caller's rows as they were.
        before = torch.full_like(tail, CALLER_BUFFER_FILL) if result.o_in_caller_buffer else None
        result = dataclasses.replace(result, o=o)
    findings = judge.result(truth.reference, result, truth.budgets, "the sequences of a padded batch")
    observed, words = classify(tail, before)
    subject = f"output rows past the sequences ({tail.shape[1]} padded tokens)"
    verdict = "warn" if observed == "garbage" else "pass"
    finding = dataclasses.replace(judge.passed(subject, "o"), verdict=verdict, observed=observed, reason=words)
    return [*findings, finding]


CHECK = Check(
    name=NAME,
    title="serving: padded tail",
    suite="serving",
    test_name="test_padded_tail_holds_no_garbage",
    summary="Token tensors padded past the last sequence: the sequences' answer stays right, and the rows past "
    "them are zero, untouched or finite, never garbage (a warning; a failure under --kda-strict).",
    draw=draw,
    run=run,
    ci_seed=0x7061646465645F7461696C,
    prepare=serving_case,
)
