"""Errors of a backend's result against the float64 truth, and the verdict against a budget.

Issue-2 scope: provisional max-abs budgets per input dtype (PROVISIONAL_BUDGETS);
the tolerance policy replaces them with derived ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kda_cases.case import Case
from kda_kernels.protocol import BackendOutput
from kda_reference.recurrent import ReferenceResult

# Max-abs budgets, provisional: about 10x the errors FLA's chunk kernel shows on
# these inputs (KDA-FACTS.md: bf16 o 3e-4..7e-4, S 4e-3..7e-3 on an H200;
# fp32 about 1e-7 under the CPU interpreter). A bf16 stored state adds its own
# rounding (2^-9 relative), hence its wider state budget.
PROVISIONAL_BUDGETS: dict[str, dict[str, float]] = {
    "bf16": {"o": 1e-2, "final_state": 5e-2},
    "fp16": {"o": 2e-3, "final_state": 2e-2},
    "fp32": {"o": 1e-4, "final_state": 1e-3},
}
BF16_STATE_BUDGET = 1e-1


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
    diff = (got64 - want).abs()
    # NaN must never slip through a comparison: non-finite entries count as infinite error.
    diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, math.inf))
    ref_rms = float(want.pow(2).mean().sqrt()) if want.numel() else 0.0
    max_abs = float(diff.max()) if diff.numel() else 0.0
    err_rms = float(diff.pow(2).mean().sqrt()) if diff.numel() else 0.0
    tiny = torch.finfo(torch.float64).tiny
    return TensorError(
        tensor=name,
        max_abs=max_abs,
        rel_rms=err_rms / max(ref_rms, tiny),
        max_abs_over_ref_rms=max_abs / max(ref_rms, tiny),
        nonfinite=nonfinite,
        shape_ok=True,
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


def provisional_budget(case: Case, tensor: str) -> float:
    if tensor != "o" and case.state_dtype == "bf16":
        return BF16_STATE_BUDGET
    return PROVISIONAL_BUDGETS[case.dtype]["o" if tensor == "o" else "final_state"]


def passes(error: TensorError, budget: float) -> bool:
    """Within budget: right shape, all finite, max-abs at most the budget."""
    return error.shape_ok and error.nonfinite == 0 and error.max_abs <= budget
