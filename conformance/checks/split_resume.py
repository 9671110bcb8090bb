"""Split and resume: the prefix [0, p), then the suffix [p, T) resumed from the prefix's returned final
state, must give the whole run's answer (the truth, and the backend's own whole run) within budget: the rule's
limits over the larger of the baseline's errors on the whole run and on the same split."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from hypothesis import strategies as st

from kda_cases.case import Case
from kda_cases.profiles import Profile
from kda_cases.strategies import CHECKPOINT_GRIDS
from kda_conformance.checks._check import Check, Param
from kda_conformance.checks._derived import split_inputs, token_slice
from kda_conformance.checks._registry import draw_case, supported
from kda_conformance.judging.judge import Judge
from kda_conformance.running.blame import call_backend
from kda_conformance.running.runnable import Drawn
from kda_conformance.running.truth import CaseTruth, baseline_backend, inputs_truth, widened
from kda_kernels.guard import run_backend_call
from kda_kernels.protocol import Backend, BackendOutput
from kda_reports.findings import Finding

NAME = "split_resume"


def splittable(case: Case, backend: Backend) -> Case:
    """The case as [B, T] rows of at least 2 tokens with an fp32 state (a bf16 pool rounds the state at
    every resume: that is the paged-pool checks' business) and no checkpoints."""
    rows = 1 if case.packed else case.num_seqs
    T = max(2, case.max_len)
    return case.replace(seq_lens=(T,) * rows, packed=False, state_dtype="fp32", checkpoints=())


def draw(data: st.DataObject, profile: Profile, backend: Backend) -> Drawn:
    case = draw_case(data, profile, backend, splittable)
    T = case.seq_lens[0]
    grid = st.sampled_from(CHECKPOINT_GRIDS).flatmap(
        lambda g: st.integers(min_value=1, max_value=max(1, (T - 1) // g)).map(lambda k: k * g)
    )
    p = data.draw(st.one_of(grid.filter(lambda x: x < T), st.integers(min_value=1, max_value=T - 1)), label="p")
    supported(backend, case)
    return Drawn(case, {"at": p})


def run(truth: CaseTruth, backend: Backend, params: Mapping[str, object], judge: Judge) -> list[Finding]:
    case, inputs, p = truth.case, truth.inputs, int(str(params["at"]))
    T = case.seq_lens[0]
    prefix_inputs, suffix_case = split_inputs(inputs, p)
    prefix = call_backend(backend, prefix_inputs)
    # Step 1 against the truth of exactly its inputs: a prefix (or its final state) that is wrong is the
    # backend's failure here, with its first bad point, and no suffix is resumed from it.
    step1 = inputs_truth(prefix_inputs, precision=truth.precision)
    first = Judge(NAME, prefix_inputs.case, backend.name, judge.device, judge.repro)
    judged = first.result(step1.reference, prefix, step1.budgets, "step 1: the prefix against its own truth")
    if any(f.failed for f in judged):
        return judged
    suffix = call_backend(backend, token_slice(inputs, p, T, prefix.final_state, suffix_case))
    if suffix.o.dim() != 4 or suffix.o.shape[::2] != prefix.o.shape[::2] or suffix.o.shape[3] != prefix.o.shape[3]:
        shapes = f"the suffix's o of shape {list(suffix.o.shape)} cannot follow the prefix's {list(prefix.o.shape)}"
        return [*judged, judge.problem("o of the suffix", shapes, tensor="o")]
    whole = call_backend(backend, inputs)
    resumed = torch.cat([prefix.o, suffix.o], dim=1)
    # The baseline split at p too: a split changes where a chunked kernel's chunks start, which can cost more
    # than the whole run (the baseline itself was 1.8x its whole-run limit on T73 fp32, correlated keys).
    base = baseline_backend(truth.precision)
    base_prefix = run_backend_call(base, prefix_inputs)
    base_suffix = run_backend_call(base, token_slice(inputs, p, T, base_prefix.final_state, suffix_case))
    split = BackendOutput(o=torch.cat([base_prefix.o, base_suffix.o], dim=1), final_state=base_suffix.final_state)
    reference, budgets = truth.reference, widened(truth, split)
    return [
        *judged,
        judge.tensor("o", resumed, reference.o, budgets["o"], "o against the truth"),
        judge.tensor(
            "final_state",
            suffix.final_state,
            reference.final_state,
            budgets["final_state"],
            "final state against the truth",
        ),
        judge.tensor("o", resumed, whole.o, budgets["o"], "o against the whole run"),
    ]


CHECK = Check(
    name=NAME,
    title="split resume",
    suite="properties",
    test_name="test_split_resume_equals_whole_run",
    summary="Prefix [0, p) then suffix [p, T) resumed from the prefix's final state: the whole run, within budget.",
    draw=draw,
    run=run,
    ci_seed=0x797C97F4E3BD6B3A20F426E7812F760362242E18F5A294CE743306EFE174A281DB24DEBC343FC1F2131C292241EE61D2,
    prepare=splittable,
    params=(Param("at", int, "the split point p of split_resume and prefix checks (tokens)"),),
)
