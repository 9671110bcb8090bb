"""A two-step (chunked) prefill: every sequence's first half written to its slot in step 1, the rest
resumed from that slot in step 2; each step judged as a request of its own."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from hypothesis import strategies as st

from kda_cases.profiles import Profile
from kda_conformance.checks._check import Check
from kda_conformance.checks._derived import step_inputs
from kda_conformance.checks._served import draw_served, request_findings, serve, serving_case
from kda_conformance.judging.judge import Judge
from kda_conformance.running.blame import NotApplicable
from kda_conformance.running.runnable import Drawn
from kda_conformance.running.truth import CaseTruth
from kda_kernels.protocol import Backend, BackendOutput
from kda_kernels.serving import build_pool, new_out, plan_pool
from kda_reports.findings import Finding

NAME = "steps"


def draw(data: st.DataObject, profile: Profile, backend: Backend) -> Drawn:
    return Drawn(draw_served(data, profile, backend, lambda case: case.max_len >= 2))


def run(truth: CaseTruth, backend: Backend, params: Mapping[str, object], judge: Judge) -> list[Finding]:
    case, inputs = truth.case, truth.inputs
    if case.max_len < 2:
        raise NotApplicable(f"a two-step prefill needs a sequence of 2 tokens or more; {case.id} has {case.seq_lens}")
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
    T1, T2 = first.case.total_tokens, second.case.total_tokens
    step1 = request_findings(
        judge,
        "two-step prefill, step 1 (first half of each sequence)",
        first,
        BackendOutput(o=out1[:, :T1], final_state=after_first),
        truth.precision,
    )
    if any(f.failed for f in step1):  # step 2 would resume from what step 1 got wrong: judged at step 1 alone
        return step1
    resumed = tuple(case.has_initial_state or c > s for (s, _), c in zip(spans, cuts, strict=True))
    serve(backend, second, pool, plan.seq_slots, resumed, out2, padding=plan.padding)
    keep = torch.tensor(resumed, device=inputs.device).view(-1, 1, 1, 1)
    stored = torch.where(keep, after_first, torch.zeros_like(after_first))
    return step1 + request_findings(
        judge,
        "two-step prefill, step 2 (the rest, resumed from the slots)",
        dataclasses.replace(second, initial_state=stored),
        BackendOutput(o=out2[:, :T2], final_state=pool[slots]),
        truth.precision,
    )


CHECK = Check(
    name=NAME,
    title="serving: two-step prefill",
    suite="serving",
    test_name="test_two_step_prefill_equals_whole_run",
    summary="A prefill split across two serving steps (the second resumed from the pool) gives each "
    "step's right answer.",
    draw=draw,
    run=run,
    ci_seed=0x22B95289DCCCA5138CE1067046C0421FC647F12A18A05D11AA781BED0D9DE7FE751195571A6175B559E1201864694921,
    prepare=serving_case,
)
