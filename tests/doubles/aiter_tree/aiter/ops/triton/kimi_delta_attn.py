"""A test double of AITER's ``aiter/ops/triton/kimi_delta_attn.py`` in a source checkout (the folder
``KDA_AITER_SRC`` names): ``chunk_kimi_delta_attn``'s keywords, the float64 token loop as its body, and
FlashKDA's switch as the module constant AITER reads from the environment at import, and its admission check
``flash_kda_supported`` (its gate rule only; each answer kept in ``ADMISSIONS``). Each call's path (the switch,
the segment variable) and arguments are kept in ``CALLS``."""

from __future__ import annotations

import os

from kda_reference.plain import kda_token_loop

AITER_FDA_ENABLE = os.environ.get("AITER_FDA_ENABLE", "1") == "1"
CALLS: list[dict] = []
ADMISSIONS: list[bool] = []


def flash_kda_supported(q, v, chunk_size, safe_gate, use_gate_in_kernel, use_qk_l2norm_in_kernel,
                        use_beta_sigmoid_in_kernel, lower_bound, A_log):  # fmt: skip
    """AITER's admission check for FlashKDA, its rule on the gate: the safe gate, computed in the kernel."""
    admitted = bool(safe_gate and use_gate_in_kernel and lower_bound is not None and A_log is not None)
    ADMISSIONS.append(admitted)
    return admitted


def chunk_kimi_delta_attn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                          cu_seqlens=None, use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                          use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None, safe_gate=False,
                          chunk_size=None, state_v_first=False, backend=None):  # fmt: skip
    CALLS.append({
        "flash_kda": AITER_FDA_ENABLE, "segment": os.environ.get("CHUNK_DELTA_ATTN_FLASH_KDA_SEG"),
        "safe_gate": safe_gate, "chunk_size": chunk_size, "backend": backend,
        "state_dtype": None if initial_state is None else initial_state.dtype, "dt_bias": dt_bias is not None,
    })  # fmt: skip
    o, final = kda_token_loop(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                              use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                              use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                              lower_bound=lower_bound, state_v_first=state_v_first)  # fmt: skip
    return o.to(v.dtype), (final.float() if output_final_state else None)
