"""Packing isolation: each sequence of a packed batch equals that sequence run alone, within budget."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from hypothesis import strategies as st

from kda_cases.case import Case
from kda_cases.profiles import Profile
from kda_conformance.checks._check import Check
from kda_conformance.checks._derived import alone_inputs
from kda_conformance.checks._registry import draw_case, supported
from kda_conformance.judging.judge import Judge
from kda_conformance.running.blame import call_backend
from kda_conformance.running.runnable import Drawn
from kda_conformance.running.truth import CaseTruth
from kda_kernels.protocol import Backend
from kda_reports.findings import Finding

NAME = "packing"


def packable(case: Case, backend: Backend) -> Case:
    """The case as a packed batch with at least two non-empty sequences."""
    if case.packed and sum(1 for n in case.seq_lens if n) >= 2:
        return case
    if not case.packed and case.num_seqs >= 2:
        return case.replace(packed=True)
    T = case.total_tokens
    return case.replace(seq_lens=(max(1, T // 2), max(1, T - T // 2)), packed=True, checkpoints=())


def draw(data: st.DataObject, profile: Profile, backend: Backend) -> Drawn:
    case = draw_case(data, profile, backend, packable)
    supported(backend, case)
    return Drawn(case)


def _rows(state: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if state is None else state[n : n + 1]


def run(truth: CaseTruth, backend: Backend, params: Mapping[str, object], judge: Judge) -> list[Finding]:
    case, inputs = truth.case, truth.inputs
    packed = call_backend(backend, inputs)
    findings = []
    for n, (row, start, end) in enumerate(case.row_spans):
        truth_state = truth.reference.final_state[n : n + 1]
        if start == end:
            # Nothing to run alone: a zero-length sequence's final state is its initial state.
            pairs = [("final_state", _rows(packed.final_state, n), truth_state)]
        else:
            alone = call_backend(backend, alone_inputs(inputs, n))
            # A final state the backend did not return is judged missing against the truth, as the budget
            # check judges it (it raised a TypeError charged to the suite).
            alone_state = truth_state if alone.final_state is None else alone.final_state
            packed_state = None if alone.final_state is None else _rows(packed.final_state, n)
            pairs = [("o", packed.o[row : row + 1, start:end], alone.o), ("final_state", packed_state, alone_state)]
        for name, got, want in pairs:
            subject = f"sequence {n} {name} packed vs alone"
            findings.append(judge.tensor(name, got, want, truth.budgets[name], subject, alone=n))
    return findings


CHECK = Check(
    name=NAME,
    title="packing isolation",
    suite="properties",
    test_name="test_packed_sequences_match_each_sequence_alone",
    summary="Each sequence of a packed batch equals that sequence run alone, within the case's budgets.",
    draw=draw,
    run=run,
    ci_seed=0xDC5CB6F3DE9220C5178037A3B2D464F0E9B301A943DB2864E672BB4B61DC33726B336A95D65EA6B4C1358F2B4604EE21,
    prepare=packable,
)
