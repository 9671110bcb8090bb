"""TEST DOUBLE: FlashKDA's switch and admission check, as AITER exposes them (module constant read from the
environment at import; the admission rule as AITER documents it)."""

from __future__ import annotations

import os

import torch

AITER_FDA_ENABLE: bool = os.getenv("AITER_FDA_ENABLE", "1").lower() in ("1", "true", "yes", "on")
FLASH_KDA_CHUNK = 32


def flash_kda_supported(
    *,
    q,
    v,
    chunk_size,
    safe_gate,
    use_gate_in_kernel,
    use_qk_l2norm_in_kernel,
    use_beta_sigmoid_in_kernel,
    lower_bound,
    A_log,
) -> bool:
    return bool(
        chunk_size == FLASH_KDA_CHUNK
        and safe_gate
        and q.shape[-1] == v.shape[-1] == 128
        and v.shape[2] == q.shape[2]
        and q.dtype == v.dtype == torch.bfloat16
        and use_gate_in_kernel
        and use_qk_l2norm_in_kernel
        and use_beta_sigmoid_in_kernel
        and lower_bound is not None
        and A_log is not None
    )
