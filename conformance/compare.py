"""Errors of a backend's result against the float64 truth: the metrics, and where they first exceed a budget.

Budgets and verdicts are the tolerance policy's (tolerance.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kda_cases.case import Case
from kda_kernels.protocol import BackendOutput
from kda_reference.recurrent import ReferenceResult


@dataclass(frozen=True)
class TensorError:
    """How far one returned tensor is from the truth."""

    tensor: str
    max_abs: float
    rel_rms: float
    max_abs_over_ref_rms: float
    nonfinite: int
    shape_ok: bool
    detail: str = ""
    # Max error per leading index: [B, T, HV] for outputs (token x head), [N, HV] for states.
    # Kept in memory to locate the first bad token once a budget is known; not reported.
    per_index: torch.Tensor | None = field(default=None, repr=False, compare=False)
    curve: tuple[float, ...] = ()  # outputs: max error per CURVE_CHUNK tokens, in token order


CURVE_CHUNK = 64


def tensor_error(name: str, got: torch.Tensor | None, want: torch.Tensor) -> TensorError:
    """Error metrics of ``got`` against the float64 ``want``; a missing or misshapen tensor is flagged."""
    if got is None:
        return TensorError(name, math.inf, math.inf, math.inf, 0, False, "backend returned no tensor")
    if tuple(got.shape) != tuple(want.shape):
        return TensorError(
            name,
            math.inf,
            math.inf,
            math.inf,
            0,
            False,
            f"shape {list(got.shape)} != expected {list(want.shape)}",
        )
    got64 = got.detach().to(device=want.device, dtype=torch.float64)
    nonfinite = int((~torch.isfinite(got64)).sum())
    raw = (got64 - want).abs()
    finite = torch.isfinite(raw)
    # NaN must never slip through a comparison: non-finite entries count as infinite error.
    diff = torch.where(finite, raw, torch.full_like(raw, math.inf))
    ref_rms = float(want.pow(2).mean().sqrt()) if want.numel() else 0.0
    max_abs = float(diff.max()) if diff.numel() else 0.0
    err_rms = float(diff.pow(2).mean().sqrt()) if diff.numel() else 0.0
    tiny = torch.finfo(torch.float64).tiny
    # Per index, a non-finite value stays NaN so that it is "bad" against any budget, infinite ones included.
    located = torch.where(finite, raw, torch.full_like(raw, math.nan))
    per_index = located.amax(dim=-1) if name == "o" else located.flatten(2).amax(dim=-1)
    curve: tuple[float, ...] = ()
    if name == "o" and diff.numel():
        per_token = per_index.amax(dim=-1).flatten()  # batch rows laid end to end
        pad = (-per_token.numel()) % CURVE_CHUNK
        padded = torch.cat([per_token, per_token.new_zeros(pad)])
        curve = tuple(padded.view(-1, CURVE_CHUNK).nan_to_num(nan=math.inf).amax(dim=-1).tolist())
    return TensorError(
        tensor=name,
        max_abs=max_abs,
        rel_rms=err_rms / max(ref_rms, tiny),
        max_abs_over_ref_rms=max_abs / max(ref_rms, tiny),
        nonfinite=nonfinite,
        shape_ok=True,
        per_index=per_index.cpu(),
        curve=curve,
    )


def compare(case: Case, truth: ReferenceResult, result: BackendOutput) -> list[TensorError]:
    """Errors of every tensor the case defines: the output and the final state (checkpoints when returned)."""
    errors = [
        tensor_error("o", result.o, truth.o),
        tensor_error("final_state", result.final_state, truth.final_state),
    ]
    if case.checkpoints and result.checkpoint_states is not None:
        errors.append(tensor_error("checkpoint_states", result.checkpoint_states, truth.checkpoint_states))
    return errors


def first_bad(case: Case, error: TensorError, budget: float) -> str:
    """Where the error first exceeds ``budget``: ``seq S token T head H`` (outputs) or ``seq S head H`` (states).

    Sequences in order, then tokens in order within a sequence; '' when nothing exceeds it.
    """
    if error.per_index is None:
        return ""
    bad = ~(error.per_index <= budget)  # NaN marks a non-finite value: bad whatever the budget
    if error.tensor != "o":
        hits = bad.nonzero()
        return f"seq {int(hits[0, 0])} head {int(hits[0, 1])}" if len(hits) else ""
    for seq, (row, start, end) in enumerate(case.row_spans):
        hits = bad[row, start:end].nonzero()
        if len(hits):
            return f"seq {seq} token {int(hits[0, 0])} head {int(hits[0, 1])}"
    return ""
