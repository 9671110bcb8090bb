"""A test double of vLLM's older vendored kda.py: fused_kda_gate before chunk_kda, K-first states."""

from kda_server_double import CALLS, kda, softplus_gate
from vllm.triton_utils import tl, triton  # noqa: F401


def fused_kda_gate(g, A, head_k_dim, g_bias=None, beta=1.0, threshold=20.0):
    return softplus_gate(g, A, g_bias)


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
    initial_state = initial_state.contiguous()
    CALLS.append({"entry": "chunk_kda", "cu_seqlens": cu_seqlens, "initial_state": initial_state, "beta": beta})
    return kda(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, v_first=False)
