"""A test double of vLLM's current vendored kda.py: its entry points and contracts, V-first states."""

from kda_server_double import CALLS, kda, softplus_gate
from vllm.platforms import current_platform  # noqa: F401  (the loader's stubs)
from vllm.triton_utils import tl, triton  # noqa: F401
from vllm.utils.math_utils import RCP_LN2, cdiv  # noqa: F401

from .utils import FLA_CHUNK_SIZE  # noqa: F401  (a sibling module of the tree)


def chunk_kda_with_fused_gate(
    q,
    k,
    v,
    raw_g,
    beta,
    A_log,
    g_bias,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    **kwargs,
):
    CALLS.append(
        {
            "entry": "chunk_kda_with_fused_gate",
            "A_log": tuple(A_log.shape),
            "cu_seqlens": cu_seqlens,
            "initial_state": initial_state,
            "beta": beta,
        }
    )
    g = softplus_gate(raw_g, A_log, g_bias)
    return kda(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, v_first=True)


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    **kwargs,
):
    initial_state = initial_state.contiguous()  # as vLLM's: it takes no None
    CALLS.append({"entry": "chunk_kda", "cu_seqlens": cu_seqlens, "initial_state": initial_state, "beta": beta})
    return kda(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, v_first=True)
