"""Measures what FLA's chunk forward allocates per token and value head, beyond its inputs, under the Triton
interpreter on the CPU.

``python tests/scratch_probe.py K V`` prints one JSON line: the bytes per token and head between two lengths
(the torch allocator's peak of live tensors during the call, from ``torch.profiler``), which is what the memory
plan of a batch of millions of tokens needs (``Backend.scratch_bytes_per_token``). A fresh process per call: the
interpreter is process-wide.

Every allocation is FLA's Python (``torch.empty``, ``torch.zeros``), sized from the shapes; what the kernels then
compute into it sizes nothing. So the probe skips the kernels' launches, which in the interpreter are nearly all
of its time: at K = V = 64 it measured 1,608.4375 bytes either way, in about 4 s against 35.6 s with the
launches (one run each on 2 cores). ``--launch`` runs them, to check that again.
"""

from __future__ import annotations

import json
import sys
import warnings

warnings.filterwarnings("ignore")
HEADS = 2
LENGTHS = (256, 512)


def peak_bytes(chunk_kda, torch, tokens: int, k: int, v: int) -> int:
    """The largest sum of live allocations during one packed bf16 call of two sequences."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(0)
    shape = (1, tokens, HEADS)
    q, key = (torch.randn(*shape, k, generator=gen).bfloat16() for _ in range(2))
    value = torch.randn(*shape, v, generator=gen).bfloat16()
    gate = -torch.rand(*shape, k, generator=gen).bfloat16()
    beta = torch.rand(*shape, generator=gen).bfloat16()
    cu_seqlens = torch.tensor([0, tokens // 2, tokens])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, torch.inference_mode():
        chunk_kda(
            q, key, value, gate, beta, output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True
        )
    # An allocation is charged to its op and to every op that called it: count each once, at the innermost.
    events = [e for e in prof.events() if e.cpu_memory_usage and not any(c.cpu_memory_usage for c in e.cpu_children)]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.time_range.start):
        live += event.cpu_memory_usage
        peak = max(peak, live)
    return peak


def main() -> None:
    k, v = int(sys.argv[1]), int(sys.argv[2])
    from kda_kernels import triton_interpret

    triton_interpret.enable()
    if "--launch" not in sys.argv[3:]:
        from triton.runtime import interpreter

        interpreter.GridExecutor.__call__ = lambda self, *args, **kwargs: None
    import torch
    from fla.ops.kda import chunk_kda

    short, long = (peak_bytes(chunk_kda, torch, t, k, v) for t in LENGTHS)
    per_token_head = (long - short) / ((LENGTHS[1] - LENGTHS[0]) * HEADS)
    print(json.dumps({"k": k, "v": v, "bytes_per_token_head": per_token_head}))


if __name__ == "__main__":
    main()
