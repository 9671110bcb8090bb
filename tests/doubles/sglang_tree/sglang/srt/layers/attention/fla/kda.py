"""A test double of SGLang's vendored kda.py (the pool API): chunk_kda reads each sequence's slot of the
whole pool and writes its final state there in place; returns the output only."""

from kda_server_double import CALLS, kda, lower_bound_gate, softplus_gate
from sglang.srt.utils import cdiv, is_cpu  # noqa: F401  (the loader's stubs)


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    initial_state_indices=None,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    beta_is_raw=False,
    **kwargs,
):
    CALLS.append(
        {
            "entry": "chunk_kda",
            "cu_seqlens": cu_seqlens,
            "indices": initial_state_indices,
            "pool": initial_state.clone(),
            "beta": beta,
            "beta_is_raw": beta_is_raw,
        }
    )
    beta = beta.float().sigmoid() if beta_is_raw else beta
    if A_log is not None:
        g = (
            softplus_gate(g, A_log, dt_bias)
            if lower_bound is None
            else lower_bound_gate(g, A_log, dt_bias, lower_bound)
        )
    slots = initial_state_indices.long()
    o, final = kda(q, k, v, g, beta, scale, initial_state[slots], use_qk_l2norm_in_kernel, cu_seqlens, v_first=True)
    initial_state[slots] = final
    return o
