"""Properties over cases drawn for the chosen profile (--kda-profile), against every selected backend.

Hypothesis draws the case's small choices; tensors come from the case's seed. A
failure prints the drawn case (Hypothesis), the suite's message and a
`kda-conformance run --case ...` line that reruns it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, target
from hypothesis import strategies as st

from kda_cases.case import Case
from kda_cases.strategies import CHECKPOINT_GRIDS, cases
from kda_conformance.properties import alone_inputs, changed_after, judged, run, split_inputs, token_slice
from kda_conformance.sweep import repro_command, run_backend
from kda_conformance.tolerance import failure_message
from kda_kernels.protocol import Backend

pytestmark = pytest.mark.kda_device_dependent


def runnable(backend: Backend, case: Case) -> Backend:
    # Outside the envelope: nothing to check for this example (not a failure, not a skip of the test).
    assume(bool(backend.supports(case)))
    return backend


def splittable(case: Case) -> Case:
    """The case as [B, T] rows of at least 2 tokens with an fp32 state (a bf16 pool rounds the state at
    every resume: that is the paged-pool checks' business) and no checkpoints."""
    rows = 1 if case.packed else case.num_seqs
    T = max(2, case.max_len)
    return case.replace(seq_lens=(T,) * rows, packed=False, state_dtype="fp32", checkpoints=())


def packable(case: Case) -> Case:
    """The case as a packed batch with at least two non-empty sequences."""
    if case.packed and sum(1 for n in case.seq_lens if n) >= 2:
        return case
    if not case.packed and case.num_seqs >= 2:
        return case.replace(packed=True)
    T = case.total_tokens
    return case.replace(seq_lens=(max(1, T // 2), max(1, T - T // 2)), packed=True, checkpoints=())


@given(data=st.data())
def test_within_budget(kda_backend, kda_profile, kda_device, kda_truth, kda_record, kda_check, data) -> None:  # type: ignore[no-untyped-def]
    """Output, final state and checkpoint states of every drawn case within the case's budgets."""
    case = data.draw(cases(kda_profile).map(kda_backend.fit), label="case")
    backend = runnable(kda_backend, case)
    outcome = run_backend(kda_truth(case, kda_device), backend)
    kda_record(outcome)
    if kda_profile.targeted and outcome.verdicts:
        # Climb toward the worst inputs: the largest error/limit ratio this backend shows.
        target(max(max(v.ratio, v.rel_rms_ratio) for v in outcome.verdicts), label=kda_backend.name)
    if outcome.status != "ran":
        kda_check(f"{case.id} {backend.name} raised {outcome.reason}\n  repro: {outcome.repro}")
    kda_check("\n".join(failure_message(case, backend.name, v, outcome.repro) for v in outcome.failed) or None)


@given(data=st.data())
def test_split_resume_equals_whole_run(kda_backend, kda_profile, kda_device, kda_truth, kda_check, data) -> None:  # type: ignore[no-untyped-def]
    """Prefix [0, p) then suffix [p, T) resumed from the prefix's final state: the whole run, within budget."""
    case = data.draw(cases(kda_profile).map(kda_backend.fit).map(splittable), label="case")
    T = case.seq_lens[0]
    grid = st.sampled_from(CHECKPOINT_GRIDS).flatmap(
        lambda g: st.integers(min_value=1, max_value=max(1, (T - 1) // g)).map(lambda k: k * g)
    )
    p = data.draw(st.one_of(grid.filter(lambda x: x < T), st.integers(min_value=1, max_value=T - 1)), label="p")
    backend = runnable(kda_backend, case)
    truth = kda_truth(case, kda_device)
    prefix_inputs, suffix_case = split_inputs(truth.inputs, p)
    prefix = run(backend, prefix_inputs)
    suffix = run(backend, token_slice(truth.inputs, p, T, prefix.final_state, suffix_case))
    whole = run(backend, truth.inputs)
    resumed = torch.cat([prefix.o, suffix.o], dim=1)
    checks = {
        "o against the truth": judged(case, "o", resumed, truth.reference.o, truth.budgets["o"]),
        "final state against the truth": judged(
            case, "final_state", suffix.final_state, truth.reference.final_state, truth.budgets["final_state"]
        ),
        "o against the whole run": judged(case, "o", resumed, whole.o, truth.budgets["o"]),
    }
    bad = {what: v for what, v in checks.items() if not v.passed}
    repro = f"(split at {p}) " + repro_command(case, backend.name, kda_device)
    kda_check(
        f"split at p={p}: "
        + "\n".join(f"{what}: " + failure_message(case, backend.name, v, repro) for what, v in bad.items())
        if bad
        else None
    )


@given(data=st.data())
def test_prefix_outputs_ignore_later_tokens(kda_backend, kda_profile, kda_device, kda_truth, kda_check, data) -> None:  # type: ignore[no-untyped-def]
    """Changing every token at and after p leaves the outputs before p bitwise unchanged (no future leakage)."""
    case = data.draw(cases(kda_profile).map(kda_backend.fit), label="case")
    length = case.total_tokens if case.packed else case.seq_lens[0]
    assume(length >= 2)
    p = data.draw(st.integers(min_value=1, max_value=length - 1), label="p")
    backend = runnable(kda_backend, case)
    inputs = kda_truth(case, kda_device).inputs
    before = run(backend, inputs).o[:, :p]
    after = run(backend, changed_after(inputs, p)).o[:, :p]
    differs = (before != after) & ~(before.isnan() & after.isnan())
    kda_check(
        f"{case.id} ({case.label}) backend {backend.name}: outputs before token {p} changed when only tokens "
        f"from {p} on did\n  first bad: row {differs.nonzero()[0, 0]} token {differs.nonzero()[0, 1]} "
        f"head {differs.nonzero()[0, 2]}\n  repro: {repro_command(case, backend.name, kda_device)}"
        if differs.any()
        else None
    )


@given(data=st.data())
def test_packed_sequences_match_each_sequence_alone(
    kda_backend, kda_profile, kda_device, kda_truth, kda_check, data
) -> None:  # type: ignore[no-untyped-def]
    """Each sequence of a packed batch equals that sequence run alone, within the case's budgets."""
    case = data.draw(cases(kda_profile).map(kda_backend.fit).map(packable), label="case")
    backend = runnable(kda_backend, case)
    truth = kda_truth(case, kda_device)
    packed = run(backend, truth.inputs)
    problems = []
    for n, (row, start, end) in enumerate(case.row_spans):
        if start == end:
            # Nothing to run alone: a zero-length sequence's final state is its initial state.
            pairs = [("final_state", packed.final_state[n : n + 1], truth.reference.final_state[n : n + 1])]
        else:
            alone = run(backend, alone_inputs(truth.inputs, n))
            pairs = [
                ("o", packed.o[row : row + 1, start:end], alone.o),
                ("final_state", packed.final_state[n : n + 1], alone.final_state),
            ]
        for name, got, want in pairs:
            verdict = judged(case, name, got, want, truth.budgets[name])
            if not verdict.passed:
                where = f" (first bad: {verdict.first_bad})" if verdict.first_bad else ""
                problems.append(f"sequence {n} {name}: " + "; ".join(verdict.problems) + where)
    kda_check(
        f"{case.id} ({case.label}) backend {backend.name}: packed differs from alone\n  "
        + "\n  ".join(problems)
        + f"\n  repro: {repro_command(case, backend.name, kda_device)}"
        if problems
        else None
    )
