"""Inputs derived from a case's inputs: a prefix and a suffix, later tokens changed, one sequence alone,
the tokens of one serving step."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kda_cases import seeded
from kda_cases.case import Case
from kda_cases.materialize import KDAInputs, cu_seqlens_tensor, materialize
from kda_conformance.running.blame import NotApplicable

TOKEN_TENSORS = ("q", "k", "v", "g", "beta")


def token_slice(inputs: KDAInputs, start: int, end: int, initial_state: torch.Tensor | None, case: Case) -> KDAInputs:
    """Tokens [start, end) of every batch row, starting from ``initial_state``, described by ``case``."""
    sliced = {name: getattr(inputs, name)[:, start:end].contiguous() for name in TOKEN_TENSORS}
    return dataclasses.replace(inputs, case=case, initial_state=initial_state, cu_seqlens=None, **sliced)


def split_inputs(inputs: KDAInputs, p: int) -> tuple[KDAInputs, Case]:
    """The prefix's inputs, and the case that describes the suffix (its state comes from the prefix run)."""
    case = inputs.case
    if case.packed:
        raise NotApplicable("split_inputs takes [B, T] batches; packed cases split per sequence")
    rows, T = case.num_seqs, case.seq_lens[0]
    if not 0 < p < T:
        raise NotApplicable(f"split point p={p} must lie inside the sequence (0 < p < {T})")
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


def step_inputs(inputs: KDAInputs, spans: list[tuple[int, int]]) -> KDAInputs:
    """The tokens ``spans`` (packed row positions) of a packed batch, as a packed batch of their own."""
    case = inputs.case
    pieces: dict[str, Any] = {
        name: torch.cat([getattr(inputs, name)[:, a:b] for a, b in spans], dim=1) for name in TOKEN_TENSORS
    }
    step = case.replace(seq_lens=tuple(b - a for a, b in spans), checkpoints=())
    return dataclasses.replace(inputs, case=step, cu_seqlens=cu_seqlens_tensor(step, inputs.device), **pieces)


def behind_filler(inputs: KDAInputs, filler_tokens: int) -> KDAInputs:
    """The case's sequences packed behind one sequence of ``filler_tokens`` zero tokens (cases/seeded.py, which
    a standalone file carries): the case's own sequences then start ``filler_tokens`` rows into every token
    tensor. Views become contiguous."""
    case = inputs.case
    tokens = {name: getattr(inputs, name) for name in TOKEN_TENSORS}
    joined, h0, cu = seeded.behind_filler(tokens, inputs.initial_state, inputs.cu_seqlens, filler_tokens)
    batch = case.replace(seq_lens=(filler_tokens, *case.seq_lens), packed=True, checkpoints=())
    return dataclasses.replace(inputs, case=batch, initial_state=h0, cu_seqlens=cu, host_metadata=None, **joined)
