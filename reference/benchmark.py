"""Time the exact reference forms side by side: ``python -m kda_reference.benchmark --device cuda``.

Prints one line per length: seconds for the float64 token loop (up to
``--loop-up-to`` tokens, it is slow) and for the chunked float64 form, and their
ratio, measured in the same process on the same inputs.
"""

from __future__ import annotations

import argparse
import time

import torch

from kda_cases.case import Case
from kda_cases.materialize import materialize
from kda_reference.chunked import kda_chunked
from kda_reference.recurrent import kda_recurrent


def _seconds(form, x, device: torch.device) -> float:  # type: ignore[no-untyped-def]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    form(x.q, x.k, x.v, x.g, x.beta, **x.kernel_kwargs())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lengths", default="2048,8192,32768,131072")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--loop-up-to", type=int, default=8192, help="longest length the token loop is timed at")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    print(f"device {device} heads {args.heads} K=V={args.head_dim}")
    print(f"{'T':>8} {'loop s':>9} {'chunked s':>10} {'loop/chunked':>13} {'peak GiB':>9}")
    for T in (int(x) for x in args.lengths.split(",")):
        case = Case(
            seq_lens=(T,),
            num_heads=args.heads,
            num_v_heads=args.heads,
            head_k_dim=args.head_dim,
            head_v_dim=args.head_dim,
            initial_state="random",
        )
        x = materialize(case, device)
        _seconds(kda_chunked, x, device)  # warm-up: allocator and kernel caches
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t_chunked = _seconds(kda_chunked, x, device)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        t_loop = float("nan")
        if T <= args.loop_up_to:
            t_loop = _seconds(kda_recurrent, x, device)
        print(f"{T:>8} {t_loop:>9.3f} {t_chunked:>10.3f} {t_loop / t_chunked:>13.1f} {peak:>9.1f}", flush=True)


if __name__ == "__main__":
    main()
