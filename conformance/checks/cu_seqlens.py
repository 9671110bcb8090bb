"""Reused ``cu_seqlens``: the three ways servers hand a kernel its sequence bounds, each a second batch (as
many sequences, new bounds) after a first, each judged against the second batch's truth:

- (a) ``in-place metadata``: the very same tensor object, the new offsets written into it in place (a
  server capturing CUDA graphs keeps persistent metadata buffers). FLA and AITER cache chunk indices on
  the identity of the tensor (``tensor_cache``, documented as not noticing in-place writes): a wrong
  answer here breaks the in-place metadata contract;
- (b) ``persistent buffer, sliced afresh``: a view of one persistent buffer, sliced anew each step;
- (c) ``fresh tensor``: a new tensor each call.

The harness hands the backend the caller's object untouched (no padding entries, so nothing to slice off).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from hypothesis import strategies as st

from kda_cases.case import Case
from kda_cases.profiles import Profile
from kda_conformance.checks._check import Check
from kda_conformance.checks._served import draw_served, serve, serving_case
from kda_conformance.judging.judge import Judge
from kda_conformance.running.blame import CONTRACT, breach_findings
from kda_conformance.running.runnable import Drawn
from kda_conformance.running.truth import CaseTruth, case_truth
from kda_kernels.protocol import Backend, BackendOutput
from kda_kernels.serving import build_pool, new_out, plan_pool
from kda_reports.findings import Finding

NAME = "cu_seqlens"
PATTERNS = ("in-place metadata", "persistent buffer, sliced afresh", "fresh tensor")


def next_batch(case: Case) -> Case:
    """The next step's batch: as many sequences, other lengths (each longer by a few tokens), other tokens."""
    lens = tuple(n + 3 * (i + 1) for i, n in enumerate(case.seq_lens))
    return case.replace(seq_lens=lens, packed=True, checkpoints=(), seed=case.seed + 1)


def draw(data: st.DataObject, profile: Profile, backend: Backend) -> Drawn:
    return Drawn(draw_served(data, profile, backend))


def _serve(backend: Backend, truth: CaseTruth, cu: torch.Tensor | None) -> BackendOutput:
    """One batch with no padding entries, through ``cu`` (its new offsets written in place) or a fresh tensor."""
    case, inputs = truth.case, truth.inputs
    plan = plan_pool(case.replace(checkpoints=()), padding=0)
    pool = build_pool(dataclasses.replace(inputs, case=case.replace(checkpoints=())), plan, "none")
    out = new_out(case, plan, "none", inputs.device)
    has_h0 = (case.has_initial_state,) * case.num_seqs
    serve(backend, inputs, pool, plan.seq_slots, has_h0, out, cu_seqlens=cu)
    return BackendOutput(o=out[:, : case.total_tokens], final_state=pool[list(plan.seq_slots)])


def run(truth: CaseTruth, backend: Backend, params: Mapping[str, object], judge: Judge) -> list[Finding]:
    case, device = truth.case.replace(checkpoints=()), truth.inputs.device
    first = dataclasses.replace(truth, case=case, inputs=dataclasses.replace(truth.inputs, case=case))
    second = case_truth(next_batch(case), device, precision=truth.precision)
    n = case.num_seqs
    persistent = torch.zeros(n + 1 + 8, dtype=torch.int32, device=device)
    same = torch.zeros(n + 1, dtype=torch.int32, device=device)
    # Each step's tensor: the same object twice, a fresh view of one buffer each step, or none (a fresh one).
    steps = {PATTERNS[0]: lambda: same, PATTERNS[1]: lambda: persistent[: n + 1], PATTERNS[2]: lambda: None}
    judged: dict[str, list[Finding]] = {}
    for pattern, step in steps.items():
        subject = f"{pattern}: second batch {second.case.seq_lens} after {case.seq_lens}"
        second_judge = Judge(NAME, second.case, backend.name, judge.device, judge.repro)
        _serve(backend, first, step())
        got = _serve(backend, second, step())
        # Stale bounds can make a kernel write where it must not (FLA's and SGLang's kernels wrote into their
        # input beta under in-place metadata on an H100): its breaches are taken here, under their pattern.
        breaches = breach_findings(second_judge, [])
        judged[pattern] = second_judge.result(second.reference, got, second.budgets, subject) + breaches
    # A failure under in-place metadata is the identity cache's only where a fresh tensor got it right: one
    # that fails every way is a plain numerical error, and says so by failing under each pattern.
    fresh_passed = {f.tensor for f in judged[PATTERNS[2]] if f.passed}
    fresh_kept_contract = all(f.subject != CONTRACT for f in judged[PATTERNS[2]])
    findings = []
    for pattern, results in judged.items():
        for finding in results:
            if finding.backend != backend.name:  # the baseline's breach, or a left thread's: as they are
                findings.append(finding)
                continue
            breach = finding.subject == CONTRACT
            observed = "right" if finding.passed else "broke the call contract" if breach else "wrong"
            problems = finding.problems
            cached = fresh_kept_contract if breach else finding.tensor in fresh_passed
            if not finding.passed and pattern == PATTERNS[0] and cached:
                problems = ("in-place metadata contract broken (a kernel caching on the tensor's identity)", *problems)
            findings.append(dataclasses.replace(finding, observed=f"{observed} under {pattern}", problems=problems))
    return findings


CHECK = Check(
    name=NAME,
    title="serving: reused cu_seqlens",
    suite="serving",
    test_name="test_reused_cu_seqlens_tensor_gets_new_bounds",
    summary="A second batch's bounds reach the kernel through the same cu_seqlens tensor written in place, a "
    "view of a persistent buffer sliced afresh, or a fresh tensor: the right answer under each.",
    draw=draw,
    run=run,
    ci_seed=0x0BE078ED76ED7E6E0C8A3963D7DDE5D322F6E9B971CC1244026B475C93AAF420D5FC12B99605119323DF80B197B2E228,
    prepare=serving_case,
)
