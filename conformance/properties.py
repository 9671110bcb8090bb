"""Inputs derived from a case's inputs for the metamorphic properties, and their checks.

- split equivalence: the prefix [0, p) then the suffix [p, T) resumed from the prefix's
  final state must match the whole run (and the truth) within the case's budgets;
- prefix invariance: changing tokens at and after p leaves outputs before p bitwise unchanged;
- packing isolation: each sequence of a packed batch matches the same sequence run alone.
"""

from __future__ import annotations

import dataclasses

import torch

from kda_cases.case import Case
from kda_cases.materialize import KDAInputs, materialize
from kda_conformance.compare import tensor_error
from kda_conformance.stages import CLOCK
from kda_conformance.tolerance import Budget, TensorVerdict, judge
from kda_kernels.protocol import Backend, BackendOutput

TOKEN_TENSORS = ("q", "k", "v", "g", "beta")


def run(backend: Backend, inputs: KDAInputs) -> BackendOutput:
    """``backend.run(inputs)``, its time counted as the backend's (conformance.stages)."""
    with CLOCK.stage("backend", inputs.device):
        return backend.run(inputs)


def token_slice(inputs: KDAInputs, start: int, end: int, initial_state: torch.Tensor | None, case: Case) -> KDAInputs:
    """Tokens [start, end) of every batch row, starting from ``initial_state``, described by ``case``."""
    sliced = {name: getattr(inputs, name)[:, start:end].contiguous() for name in TOKEN_TENSORS}
    return dataclasses.replace(inputs, case=case, initial_state=initial_state, cu_seqlens=None, **sliced)


def split_inputs(inputs: KDAInputs, p: int) -> tuple[KDAInputs, Case]:
    """The prefix's inputs, and the case that describes the suffix (its state comes from the prefix run)."""
    case = inputs.case
    if case.packed:
        raise ValueError("split_inputs takes [B, T] batches; packed cases split per sequence")
    rows, T = case.num_seqs, case.seq_lens[0]
    if not 0 < p < T:
        raise ValueError(f"split point p={p} must lie inside the sequence (0 < p < {T})")
    prefix_case = case.replace(seq_lens=(p,) * rows, checkpoints=(), tags=(*case.tags, f"prefix of {case.id}"))
    suffix_case = case.replace(seq_lens=(T - p,) * rows, checkpoints=(), tags=(*case.tags, f"suffix of {case.id}"))
    return token_slice(inputs, 0, p, inputs.initial_state, prefix_case), suffix_case


def changed_after(inputs: KDAInputs, p: int) -> KDAInputs:
    """The same inputs with every token at packed-row position >= p replaced by another draw of the case."""
    other = materialize(inputs.case.replace(seed=inputs.case.seed + 1), inputs.device)
    changed = {}
    for name in TOKEN_TENSORS:
        x = getattr(inputs, name).clone()
        x[:, p:] = getattr(other, name)[:, p:]
        changed[name] = x
    return dataclasses.replace(inputs, **changed)


def alone_inputs(inputs: KDAInputs, sequence: int) -> KDAInputs:
    """One sequence of a packed case as a case of its own, with its own initial state."""
    case = inputs.case
    _, start, end = case.row_spans[sequence]
    h0 = None if inputs.initial_state is None else inputs.initial_state[sequence : sequence + 1].clone()
    alone_case = case.replace(
        seq_lens=(end - start,), packed=False, checkpoints=(), tags=(*case.tags, f"sequence {sequence} of {case.id}")
    )
    return token_slice(inputs, start, end, h0, alone_case)


def judged(case: Case, name: str, got: torch.Tensor | None, want: torch.Tensor, budget: Budget) -> TensorVerdict:
    """Verdict on ``got`` against ``want`` (the truth, or another run) with the case's budget for ``name``."""
    return judge(case, tensor_error(name, got, want.to(torch.float64)), budget, None if got is None else got.dtype)
