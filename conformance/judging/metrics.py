"""Errors of a returned tensor against the float64 truth (or another run), and where they first pass a limit."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from kda_cases.case import Case
from kda_cases.dtypes import CHECKED_TENSORS, PARAMETER_GRADIENTS, TOKEN_TENSORS
from kda_reports.findings import Errors, Location

CURVE_CHUNK = 64


class Tensors(Protocol):
    """Anything holding the checked tensors by name: a backend's output or the float64 truth (read only,
    so a truth that always has its states is one too)."""

    @property
    def o(self) -> torch.Tensor: ...

    @property
    def final_state(self) -> torch.Tensor | None: ...

    @property
    def checkpoint_states(self) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class Measurement:
    """One tensor's errors, and its largest error per leading index (``[B, T, HV]`` for outputs, token by
    head; ``[N, HV]`` for states), kept to locate the first point past a limit once the limit is known."""

    tensor: str
    errors: Errors
    per_index: torch.Tensor | None = None


def rms_past_one_ulp(err: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """The RMS of the errors ``err`` (of a result of ``dtype`` against the float64 ``want``), its largest error
    counted less one ulp of ``dtype`` at that element's exact value: a kernel that returns one element as the
    other neighbour of its exact value (FLA's chunk backward, dg 8.25 for 8.1877 in bf16 on a 5-token sequence,
    99.99 % of that part's squared error) has rounded it, which a small part's RMS makes look large and no
    kernel can be asked to avoid; an error spread over the elements keeps all but one element's worth
    (kda-conformance docs/tolerance.md, "one ulp at one element"). Standalone files carry it verbatim: it uses
    torch and math only."""
    if not err.numel():
        return 0.0
    total = float(err.pow(2).sum())
    worst = int(err.argmax())
    largest = float(err.flatten()[worst])
    if not (math.isfinite(total) and dtype.is_floating_point):
        return math.sqrt(total / err.numel())
    exact = want.flatten()[worst].abs().to(dtype)
    ulp = float(exact.nextafter(torch.tensor(math.inf, dtype=dtype, device=exact.device))) - float(exact)
    if not math.isfinite(ulp):  # an exact value at or past the dtype's largest finite one: nothing is forgiven
        ulp = 0.0
    forgiven = max(largest - ulp, 0.0)
    return math.sqrt(max(total - largest**2 + forgiven**2, 0.0) / err.numel())


def measure(name: str, got: torch.Tensor | None, want: torch.Tensor, scale_rms: float = 0.0) -> Measurement:
    """Error metrics of ``got`` against the float64 ``want``; a missing or misshapen tensor is flagged. Rel-RMS
    divides by the larger of ``want``'s RMS and ``scale_rms`` (a gradient whose terms cancel is measured against
    its terms: conformance/running/gradient_truth.py)."""
    if got is None:
        return Measurement(name, Errors(math.inf, math.inf, math.inf, 0, False, "backend returned no tensor"))
    if tuple(got.shape) != tuple(want.shape):
        detail = f"shape {list(got.shape)} != expected {list(want.shape)}"
        return Measurement(name, Errors(math.inf, math.inf, math.inf, 0, False, detail))
    got64 = got.detach().to(device=want.device, dtype=torch.float64)
    nonfinite = int((~torch.isfinite(got64)).sum())
    raw = (got64 - want).abs()
    finite = torch.isfinite(raw)
    # NaN must never slip through a comparison: non-finite entries count as infinite error.
    diff = torch.where(finite, raw, torch.full_like(raw, math.inf))
    ref_rms = max(float(want.pow(2).mean().sqrt()) if want.numel() else 0.0, scale_rms)
    max_abs = float(diff.max()) if diff.numel() else 0.0
    err_rms = rms_past_one_ulp(diff, want, got.dtype)
    tiny = torch.finfo(torch.float64).tiny
    # Per index, a non-finite value stays NaN so that it is "bad" against any limit, infinite ones included.
    located = torch.where(finite, raw, torch.full_like(raw, math.nan))
    per_index: torch.Tensor | None = None  # a parameter's gradient is shared by every token: no place to name
    if name == "dbeta":  # [B, T, HV] already
        per_index = located
    elif name not in PARAMETER_GRADIENTS:
        per_index = located.amax(dim=-1) if name in TOKEN_TENSORS else located.flatten(2).amax(dim=-1)
    curve: tuple[float, ...] = ()
    if name == "o" and diff.numel():
        per_token = located.amax(dim=-1).amax(dim=-1).flatten()  # batch rows laid end to end
        pad = (-per_token.numel()) % CURVE_CHUNK
        padded = torch.cat([per_token, per_token.new_zeros(pad)])
        curve = tuple(padded.view(-1, CURVE_CHUNK).nan_to_num(nan=math.inf).amax(dim=-1).tolist())
    errors = Errors(
        max_abs=max_abs,
        rel_rms=err_rms / max(ref_rms, tiny),
        max_abs_over_ref_rms=max_abs / max(ref_rms, tiny),
        nonfinite=nonfinite,
        shape_ok=True,
        curve=curve,
    )
    return Measurement(name, errors, None if per_index is None else per_index.cpu())


def measure_result(case: Case, truth: Tensors, result: Tensors) -> list[Measurement]:
    """Errors of every tensor the case defines: the output and the final state (checkpoints when returned)."""
    return [
        measure(name, getattr(result, name), getattr(truth, name))
        for name in CHECKED_TENSORS
        if name != "checkpoint_states" or (case.checkpoints and result.checkpoint_states is not None)
    ]


def locate_largest(case: Case, measurement: Measurement) -> Location | None:
    """Where the error is largest (the first such point, in ``locate``'s order): the place to look for a
    failure of the rel-RMS limit alone, which has no point past the max-abs limit; None without per-index
    errors or with none above zero."""
    if measurement.per_index is None or not measurement.per_index.numel():
        return None
    largest = float(measurement.per_index.nan_to_num(nan=math.inf).max())
    if not largest > 0:
        return None
    # locate() takes the points past a limit: just under the largest error, that is the largest.
    below = float(torch.nextafter(torch.tensor(largest, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)))
    return locate(case, measurement, below)


def locate(case: Case, measurement: Measurement, limit: float) -> Location | None:
    """Where the error first exceeds ``limit``: a token and head of a sequence (outputs, and the gradients of
    token tensors) or a sequence and head (states, the initial state's gradient); sequences in order, then tokens
    in order within a sequence; None when nothing does."""
    if measurement.per_index is None:
        return None
    bad = ~(measurement.per_index <= limit)  # NaN marks a non-finite value: bad whatever the limit
    if measurement.tensor == "checkpoint_states":  # the n-th checkpoint: a sequence at a token, as the case says
        hits = bad.nonzero()
        if not len(hits):
            return None
        n = int(hits[0, 0])
        seq, position = case.checkpoints[n]
        return Location(sequence=seq, token=position, head=int(hits[0, 1]), checkpoint=n)
    if measurement.tensor not in TOKEN_TENSORS:
        hits = bad.nonzero()
        return Location(sequence=int(hits[0, 0]), head=int(hits[0, 1])) if len(hits) else None
    for seq, (row, start, end) in enumerate(case.row_spans):
        hits = bad[row, start:end].nonzero()
        if len(hits):
            return Location(sequence=seq, token=int(hits[0, 0]), head=int(hits[0, 1]))
    return None
