"""A test double of SGLang's vendored kda.py (the pool API): chunk_kda reads each sequence's slot of the
whole pool and writes its final state there in place; returns the output only."""

import torch
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
    chunk_indices=None,
    chunk_offsets=None,
    **kwargs,
):
    if chunk_indices is not None:  # as SGLang 0.5.23's graph prefill builds them: real rows, then padding
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long().cpu()
        counts = (lens + 63) // 64
        real = int(counts.sum())
        seqs = torch.repeat_interleave(torch.arange(len(lens)), counts)
        within = torch.arange(real) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        assert torch.equal(chunk_indices[:real].cpu().long(), torch.stack([seqs, within], 1)), "chunk_indices"
        assert bool((chunk_indices[real:, 1].cpu() >= 1 << 20).all()), "padded chunk rows point past every sequence"
        assert chunk_offsets.cpu().long().tolist() == [0, *counts.cumsum(0).tolist()], "chunk_offsets"
    CALLS.append(
        {
            "entry": "chunk_kda",
            "chunk_indices": chunk_indices,
            "chunk_offsets": chunk_offsets,
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
