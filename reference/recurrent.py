"""The definition: KDA as a float64 token-by-token recurrence.

Per sequence and value head, with ``q`` already scaled and the state ``S`` K-first
``[K, V]``, for each token ``t``::

    S   <- S * exp(g_t)[:, None]                 decay per key row
    S   <- S + (beta_t k_t) (v_t - k_t^T S)^T    delta rule on the decayed S
    o_t <- q_t^T S                               read after the update

Everything runs in float64 on the inputs' device; nothing is lower precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kda_cases.materialize import KDAOptions
from kda_reference.plain import token_loop
from kda_reference.prepared import Prepared, check_inputs


@dataclass(frozen=True)
class ReferenceResult:
    """Float64 truth. States use the layout that was asked for (K-first or V-first)."""

    o: torch.Tensor  # [B, T, HV, V]
    final_state: torch.Tensor  # [N, HV, K, V] or [N, HV, V, K]
    checkpoint_states: torch.Tensor  # [C, HV, K, V] or [C, HV, V, K], C = len(checkpoints)


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    options: KDAOptions | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> ReferenceResult:
    """Run the KDA recurrence in float64 with chunk_kda's conventions.

    Shapes: ``q, k [B,T,H,K]``, ``v [B,T,HV,V]``, ``g [B,T,HV,K]``, ``beta [B,T,HV]``;
    ``options.initial_state [N,HV,K,V]`` (``[N,HV,V,K]`` when ``state_v_first``).
    ``options.checkpoints`` lists ``(sequence, tokens)`` pairs: the state of that sequence
    after its first ``tokens`` tokens (0 gives its initial state).

    ``compute_dtype=torch.float32`` runs the same loop in float32: a token-serial float32 kernel (the
    arithmetic of FLA's fused recurrent kernel), one of the correct implementations the suite's own tests hold
    to passing. The definition is float64.
    """
    if compute_dtype not in (torch.float64, torch.float32):
        raise ValueError(f"compute_dtype must be float64 or float32, got {compute_dtype}")
    return _token_loop(check_inputs(q, k, v, g, beta, options or KDAOptions(), compute_dtype).prepared())


def _token_loop(p: Prepared) -> ReferenceResult:
    o, final, saved = token_loop(p.q, p.k, p.v, p.g, p.beta, p.h0, p.bounds, p.checkpoints)
    if p.state_v_first:
        final, saved = final.transpose(-1, -2), saved.transpose(-1, -2)
    return ReferenceResult(o=o, final_state=final.contiguous(), checkpoint_states=saved.contiguous())
