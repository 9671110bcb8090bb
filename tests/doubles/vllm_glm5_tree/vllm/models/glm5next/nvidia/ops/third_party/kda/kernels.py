"""A test double of vLLM 0.33's GLM-5.3-Flash KDA kernels module (vllm/models/glm5next/nvidia/...): the
fused-gate entry takes beta activated, A_log as the layer's [1, 1, H, 1] parameter and the safe gate's lower
bound; V-first fp32 states; the output written into v's buffer. It asks current_platform for the device's
capability, as the real kernels do on CUDA."""

from kda_server_double import CALLS, kda, lower_bound_gate, softplus_gate
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton  # noqa: F401  (the loader's stubs)
from vllm.utils.math_utils import RCP_LN2, cdiv, next_power_of_2  # noqa: F401


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
    safe_gate=False,
    lower_bound=-5.0,
    **kwargs,
):
    current_platform.has_device_capability(80)  # a CPU answers False; a missing stub would say so
    CALLS.append({"entry": "glm5_chunk_kda_with_fused_gate", "A_log": tuple(A_log.shape), "safe_gate": safe_gate,
                  "lower_bound": lower_bound, "initial_state": initial_state, "beta": beta,
                  "l2norm": use_qk_l2norm_in_kernel, "cu_seqlens": cu_seqlens})  # fmt: skip
    g = lower_bound_gate(raw_g, A_log, g_bias, lower_bound) if safe_gate else softplus_gate(raw_g, A_log, g_bias)
    return kda(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, v_first=True)
