"""Checkpoint resume: each checkpoint written to its slot by the batch (against the truth, within budget),
then resumed by a later request (the rest of its sequence, reading that slot), judged as a request of
its own."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from hypothesis import strategies as st

from kda_cases.profiles import Profile
from kda_conformance.checks._check import Check
from kda_conformance.checks._derived import step_inputs
from kda_conformance.checks._served import (
    draw_served,
    request_findings,
    run_serving,
    serve,
    served_result,
    serving_case,
)
from kda_conformance.judging.judge import Judge
from kda_conformance.running.runnable import Drawn
from kda_conformance.running.truth import CaseTruth
from kda_kernels.protocol import Backend, BackendOutput
from kda_kernels.serving import new_out, plan_pool
from kda_reports.findings import Finding

NAME = "checkpoint"


def draw(data: st.DataObject, profile: Profile, backend: Backend) -> Drawn:
    return Drawn(draw_served(data, profile, backend, lambda c: any(c.seq_lens[s] > p for s, p in c.checkpoints)))


def requires(backend: Backend) -> str | None:
    if not backend.envelope.checkpoints:
        return f"{backend.name} takes no cases with checkpoints (its envelope)"
    return None if backend.produces_checkpoints else f"{backend.name} returns no checkpoint states"


def run(truth: CaseTruth, backend: Backend, params: Mapping[str, object], judge: Judge) -> list[Finding]:
    case, inputs = truth.case, truth.inputs
    plan = plan_pool(case)
    served = run_serving(backend, inputs, plan, "nan")
    findings = [
        f
        for f in judge.result(truth.reference, served_result(served), truth.budgets, "checkpoint slots after the batch")
        if f.tensor == "checkpoint_states"
    ]
    if any(f.failed for f in findings):  # a request resumed from a wrong checkpoint: judged at the batch alone
        return findings
    for j, ((seq, position), slot) in enumerate(zip(case.checkpoints, plan.checkpoint_slots, strict=True)):
        _, start, end = case.row_spans[seq]
        if start + position == end:
            continue  # nothing left to resume
        later = step_inputs(inputs, [(start + position, end)])
        pool = served.pool.clone()
        out = new_out(later.case, plan, "nan", inputs.device)
        serve(backend, later, pool, (slot,), (True,), out)
        findings += request_findings(
            judge,
            f"request resumed from checkpoint {j} (slot {slot}, sequence {seq} at token {position})",
            dataclasses.replace(later, initial_state=served.pool[[slot]]),
            BackendOutput(o=out[:, : end - start - position], final_state=pool[[slot]]),
            truth.precision,
        )
    return findings


CHECK = Check(
    name=NAME,
    title="serving: checkpoint resume",
    suite="serving",
    test_name="test_request_resumes_from_checkpoint_slot",
    summary="Checkpoint states written to their slots are right, and a later request resumed from one "
    "gives the right answer.",
    draw=draw,
    run=run,
    ci_seed=0xAFB08797A80F9C8CA55FE3FC362AA729819B3501658F5D31AA1A6755620727CB7E36C34DCA0A1F78A9C2706F11A90D29,
    prepare=serving_case,
    requires=requires,
)
