"""Input preprocessing shared by the reference and every backend that needs it.

Each function follows fla-core 0.6.0 (``fla/ops/kda/gate.py``, ``chunk.py``) and
computes in the dtype of its input, so the reference calls it on float64 tensors
and a working-precision baseline on float32 ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dimension, as ``use_qk_l2norm_in_kernel`` does."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def beta_activation(beta: torch.Tensor, sigmoid: bool) -> torch.Tensor:
    """``sigmoid(beta)`` when the kernel applies it (``use_beta_sigmoid_in_kernel``), else ``beta``."""
    return torch.sigmoid(beta) if sigmoid else beta


def gate_activation(
    g: torch.Tensor,
    *,
    in_kernel: bool,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """The per-key log decay from the gate input ``g`` of shape ``[..., HV, K]``.

    Not ``in_kernel``: ``g`` already is the log decay. In kernel, with
    ``lower_bound`` None: ``-exp(A_log) * softplus(g + dt_bias)``; with a lower
    bound ``lb``: ``lb * sigmoid(exp(A_log) * (g + dt_bias))`` (``A_log`` may then
    be None: ``lb * sigmoid(g + dt_bias)``). The form follows ``lower_bound is
    not None``, not ``safe_gate``.
    """
    if not in_kernel:
        return g
    HV, K = g.shape[-2], g.shape[-1]
    x = g
    if dt_bias is not None:
        x = x + dt_bias.to(g.dtype).reshape(HV, K)
    if lower_bound is None:
        if A_log is None:
            raise ValueError("A_log is required for the softplus gate (lower_bound=None)")
        rate = torch.exp(A_log.to(g.dtype)).reshape(HV, 1)
        return -rate * F.softplus(x, beta=1.0, threshold=SOFTPLUS_THRESHOLD)
    if A_log is not None:
        x = torch.exp(A_log.to(g.dtype)).reshape(HV, 1) * x
    return lower_bound * torch.sigmoid(x)
