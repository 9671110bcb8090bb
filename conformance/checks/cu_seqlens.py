"""A reused ``cu_seqlens`` tensor: one tensor object, given a second batch's offsets in place, must give the
second batch's answer (a kernel caching chunk indices on the tensor's identity returns stale bounds)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from hypothesis import strategies as st

from kda_cases.case import Case
from kda_cases.profiles import Profile
from kda_conformance.checks.registry import Check, Drawn
from kda_conformance.checks.served import draw_served, serve, serving_case
from kda_conformance.judging.judge import Judge, judge_for
from kda_conformance.running.truth import CaseTruth, case_truth
from kda_kernels.protocol import Backend, BackendOutput
from kda_kernels.serving import build_pool, new_out, plan_pool
from kda_reports.findings import Finding

NAME = "cu_seqlens"


def resplit(case: Case) -> Case:
    """The same tokens cut into sequences differently: what a reused ``cu_seqlens`` tensor is given next."""
    T = case.total_tokens
    lens = (T,) if case.num_seqs > 1 else (T - T // 2, T // 2) if T > 1 else (T, 0)
    return case.replace(seq_lens=lens, packed=True, checkpoints=())


def draw(data: st.DataObject, profile: Profile, backend: Backend) -> Drawn:
    return Drawn(draw_served(data, profile, backend))


def run(truth: CaseTruth, backend: Backend, params: Mapping[str, object]) -> list[Finding]:
    case, inputs, device = truth.case, truth.inputs, truth.inputs.device
    judge = judge_for(NAME, case, backend.name, device, params)
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
    what = f"second batch through the same cu_seqlens tensor ({other.case.seq_lens} after {case.seq_lens})"
    second = Judge(NAME, other.case, backend.name, judge.device, judge.repro)
    return second.result(other.reference, result, other.budgets, what)


CHECK = Check(
    name=NAME,
    title="serving: reused cu_seqlens",
    suite="serving",
    test_name="test_reused_cu_seqlens_tensor_gets_new_bounds",
    summary="One cu_seqlens tensor reused with a second batch's offsets written in place gives the second "
    "batch's answer.",
    draw=draw,
    run=run,
    ci_seed=0x0BE078ED76ED7E6E0C8A3963D7DDE5D322F6E9B971CC1244026B475C93AAF420D5FC12B99605119323DF80B197B2E228,
    prepare=serving_case,
)
