"""A test double of vLLM 0.33's Kimi KDA copy (a package): the fused-gate entry takes beta raw (its sigmoid
inside) and the lower-bound gate; A_log is the layer's [H] parameter; V-first states."""

from kda_server_double import CALLS, kda, lower_bound_gate, softplus_gate
from vllm.triton_utils import tl, tldevice, triton  # noqa: F401  (the loader's stubs)
from vllm.utils.gpu_sync_debug import gpu_sync_allowed  # noqa: F401
from vllm.utils.torch_utils import async_tensor_h2d  # noqa: F401


def chunk_kda_with_fused_gate(
    q,
    k,
    v,
    raw_g,
    raw_beta,
    A_log,
    g_bias,
    scale=None,
    initial_state=None,
    output_final_state=False,
    lower_bound=None,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    out=None,
    **kwargs,
):
    CALLS.append({"entry": "chunk_kda_with_fused_gate", "A_log": tuple(A_log.shape), "raw_beta": raw_beta,
                  "lower_bound": lower_bound, "initial_state": initial_state, "out": out})  # fmt: skip
    assert A_log.dim() == 1, "vLLM 0.33's layer holds A_log as [H]"
    g = (
        softplus_gate(raw_g, A_log, g_bias)
        if lower_bound is None
        else lower_bound_gate(raw_g, A_log, g_bias, lower_bound)
    )
    beta = raw_beta.float().sigmoid()
    o, final = kda(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, v_first=True)
    if out is None:
        return o, final
    out.copy_(o)  # as vLLM 0.33's: the output written into the buffer the layer hands it
    return out, final


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):  # fmt: skip
    CALLS.append({"entry": "chunk_kda", "initial_state": initial_state, "beta": beta})
    return kda(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, v_first=True)
