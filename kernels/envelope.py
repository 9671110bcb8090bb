"""Envelopes shared by the chunk_kda-style kernels (FLA's and AITER's): what every one of them refuses."""

from __future__ import annotations

from kda_cases.case import Case
from kda_kernels.protocol import Support

MAX_HEAD_K_DIM = 256
# The range chunk_kda and AITER accept for lower_bound when the safe gate is computed in the kernel.
SAFE_LOWER_BOUND_RANGE = (-5.0, 0.0)


def in_safe_range(lower_bound: float | None) -> bool:
    lo, hi = SAFE_LOWER_BOUND_RANGE
    return lo <= (lower_bound or 0.0) < hi


def head_dim_envelope(case: Case, library: str) -> Support:
    if case.head_k_dim > MAX_HEAD_K_DIM:
        return Support.no(f"{library} supports head_k_dim <= {MAX_HEAD_K_DIM}, the case has {case.head_k_dim}")
    return Support.yes()


def safe_gate_envelope(case: Case, what: str) -> Support:
    """``what`` (the kernel's safe gate) takes lower_bound in SAFE_LOWER_BOUND_RANGE when it computes the
    gate itself."""
    if case.safe_gate and case.gate_in_kernel and not in_safe_range(case.lower_bound):
        lo, hi = SAFE_LOWER_BOUND_RANGE
        return Support.no(f"{what} needs lower_bound in [{lo:g}, {hi:g}), the case has {case.lower_bound}")
    return Support.yes()
