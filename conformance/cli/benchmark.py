"""``kda-conformance benchmark``: the exact reference forms timed beside FLA's float32 loop and the kernels
under test, in one run.

    kda-conformance benchmark --device cuda --backends fla_chunk,fla_recurrent,torch_chunk

For each length (one sequence, ``--heads`` heads, K = V = ``--head-dim``, bf16
inputs, a random initial state) it times, on the same inputs in the same
process: the float64 token loop (the definition), the chunked float64 form,
FLA's ``naive_recurrent_kda`` (a float32 token loop) and each ``--backend``.
Every contender gets one untimed warm-up call (the loops at a short length:
kernel caches, the allocator, Triton's compile and autotune) and the median of
``--repeats`` timed calls (one for the loops, whose calls take seconds); on a
GPU every timing is synchronized. It prints seconds, each contender's time
over the chunked form's, the time to draw the inputs, peak memory (on a GPU the allocator's peak
during each contender's calls, inputs and outputs included; on the CPU only the chunked form's: the
process's high-water mark after its calls), and a roofline of the
chunked form: its matmul flops against the device's measured float64 matmul
rate, the bytes it allocates (each written at least once, read at least once)
against the measured copy bandwidth.

``--small`` instead times the two exact forms at a few short lengths with the
``ci`` profile's shape, the measurement behind ``CHUNKED_FROM_TOKENS``.
"""

from __future__ import annotations

import argparse
import functools
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console

from kda_cases.case import Case
from kda_cases.devices import resolve_device, synchronize
from kda_cases.files import atomic_write_text
from kda_cases.materialize import KDAInputs, materialize
from kda_conformance.cli.common import add_backends, add_device, say, typed
from kda_conformance.cli.exits import USAGE
from kda_conformance.running.option_values import parse_count, parse_lengths
from kda_kernels import registry
from kda_reference.chunked import DEFAULT_CHUNK, kda_chunked
from kda_reference.recurrent import kda_recurrent

EXAMPLE = "kda-conformance benchmark --device cuda --backend fla_chunk --lengths 2048,131072"

LOOP_WARMUP_TOKENS = 64


def benchmark_case(T: int, heads: int, head_dim: int) -> Case:
    """A precomputed log gate (bounded) and activated beta: inputs FLA's naive loop takes as they are."""
    return Case(
        seq_lens=(T,),
        num_heads=heads,
        num_v_heads=heads,
        head_k_dim=head_dim,
        head_v_dim=head_dim,
        dtype="bf16",
        gate="log",
        lower_bound=-5.0,
        safe_gate=True,
        l2norm_in_kernel=False,
        beta_sigmoid_in_kernel=False,
        initial_state="random",
    )


def chunked_flops(T: int, heads: int, K: int, V: int, C: int = DEFAULT_CHUNK) -> float:
    """Matmul and triangular-solve flops of the chunked form: per token and head, the two intra-chunk
    products (4CK), the solve for u and w (C(V+K)), w S, K^T U and Q S (6KV) and A U (2CV)."""
    return float(T) * heads * (4 * C * K + C * (V + K) + 6 * K * V + 2 * C * V)


def _timed(call: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, float, float]:
    """Median seconds, peak GiB of the calls, GiB allocated per call (GPU; NaN on the CPU)."""
    seconds = []
    peak = allocated = float("nan")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_stats(device).get("allocated_bytes.all.allocated", 0)
        synchronize(device)
        start = time.perf_counter()
        call()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device) / 2**30
            allocated = (torch.cuda.memory_stats(device)["allocated_bytes.all.allocated"] - before) / 2**30
    return statistics.median(seconds), peak, allocated


def device_ceilings(device: torch.device) -> tuple[float, float]:
    """Measured float64 matmul rate (flop/s) and copy bandwidth (bytes/s, read + written) of ``device``."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, dtype=torch.float64, device=device)
    b = torch.randn(n, n, dtype=torch.float64, device=device)
    a @ b
    seconds, _, _ = _timed(lambda: a @ b, device, 5)
    rate = 2 * n**3 / seconds
    x = torch.empty(2**30 // 8 if device.type == "cuda" else 2**25 // 8, dtype=torch.float64, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    seconds, _, _ = _timed(lambda: y.copy_(x), device, 10)
    return rate, 2 * x.numel() * 8 / seconds


def _forms(x: KDAInputs) -> dict[str, Callable[[], object]]:
    return {
        "loop": lambda: kda_recurrent(x.q, x.k, x.v, x.g, x.beta, x.options),
        "chunked": lambda: kda_chunked(x.q, x.k, x.v, x.g, x.beta, x.options),
    }


def _fla_naive(x: KDAInputs) -> Callable[[], object] | None:
    try:
        from fla.ops.kda.naive import naive_recurrent_kda
    except ImportError:
        return None
    h0 = x.initial_state.float() if x.initial_state is not None else None
    return lambda: naive_recurrent_kda(x.q, x.k, x.v, x.g, x.beta, scale=x.case.scale, initial_state=h0)


def run_benchmark(args: argparse.Namespace) -> list[str]:
    device = torch.device(args.device)
    backends = [registry.get(name) for name in args.backends]
    untimed: dict[str, str] = {}  # why a contender's cell is nan, said under the table
    rate, bandwidth = device_ceilings(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"Device: {name}; heads {args.heads}, K = V = {args.head_dim}, bf16 inputs, random initial state, "
        f"chunk {DEFAULT_CHUNK}. Measured ceilings: float64 matmul {rate / 1e12:.2f} TFLOP/s, "
        f"copy {bandwidth / 1e12:.2f} TB/s (read + written).",
        "",
    ]
    contenders = ["loop", "chunked", "fla_naive_fp32", *(b.name for b in backends)]
    header = ["T", "inputs s", *(f"{c} s" for c in contenders)]
    header += [f"{c} / chunked" for c in contenders if c != "chunked"]
    header += [f"{c} peak GiB" for c in contenders]
    header += ["chunked GFLOP", "chunked GiB allocated", "roofline s", "chunked / roofline"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    print("\n".join(lines), flush=True)
    # Warm the loops' kernels at a short length, so their long timings hold no first-call cost.
    short = materialize(benchmark_case(LOOP_WARMUP_TOKENS, args.heads, args.head_dim), device)
    _forms(short)["loop"]()
    naive_short = _fla_naive(short)
    if naive_short is not None:
        naive_short()
    for T in args.lengths:
        # Drawing the inputs (on the CPU, from the case's seed) is part of every case's cost.
        synchronize(device)
        start = time.perf_counter()
        x = materialize(benchmark_case(T, args.heads, args.head_dim), device)
        synchronize(device)
        inputs_seconds = time.perf_counter() - start
        calls: dict[str, Callable[[], object] | None] = dict(_forms(x))
        calls["fla_naive_fp32"] = _fla_naive(x)
        if calls["fla_naive_fp32"] is None:
            untimed["fla_naive_fp32"] = "fla-core is not installed"
        for backend in backends:
            available = backend.availability(device)
            supported = backend.supports(x.case) if available else available
            calls[backend.name] = functools.partial(backend.run, x) if supported else None
            if not supported:
                untimed[backend.name] = f"T={T}: {supported.reason}"
        seconds: dict[str, float] = {}
        peaks = dict.fromkeys(calls, float("nan"))
        chunked_allocated = float("nan")
        for contender, call in calls.items():
            if call is None:
                seconds[contender] = float("nan")
                continue
            loop_like = contender in ("loop", "fla_naive_fp32")
            if loop_like and args.loop_up_to and T > args.loop_up_to:
                seconds[contender] = float("nan")
                untimed[contender] = f"not timed above --loop-up-to {args.loop_up_to} tokens"
                continue
            if not loop_like:
                call()  # warm-up: compile, autotune, allocator
            s, peak, allocated = _timed(call, device, 1 if loop_like else args.repeats)
            seconds[contender], peaks[contender] = s, peak
            if contender == "chunked":
                chunked_allocated = allocated
                if device.type == "cpu":  # the process's high-water mark: the lengths go up, the loop before
                    peaks[contender] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        flops = chunked_flops(T, args.heads, args.head_dim, args.head_dim)
        moved = 2 * chunked_allocated * 2**30  # every allocated byte written once and read at least once
        roofline = max(flops / rate, moved / bandwidth if moved == moved else 0.0)
        base = seconds["chunked"]
        row = [str(T), f"{inputs_seconds:.3g}", *(f"{seconds[c]:.4g}" for c in contenders)]
        row += [f"{seconds[c] / base:.3g}" for c in contenders if c != "chunked"]
        row += [f"{peaks[c]:.3g}" for c in contenders]
        row += [f"{flops / 1e9:.4g}", f"{chunked_allocated:.4g}", f"{roofline:.3g}"]
        row += [f"{base / roofline:.3g}"]
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
        del x, calls
        if device.type == "cuda":
            torch.cuda.empty_cache()
    notes = [f"nan for {contender}: {why}" for contender, why in untimed.items()]
    if notes:
        print("\n".join(["", *notes]), flush=True)
    return lines + (["", *notes] if notes else [])


def run_small(args: argparse.Namespace) -> list[str]:
    """The two exact forms at short lengths in the ci profile's shape (2 heads, K = V = 32)."""
    device = torch.device(args.device)
    lines = ["| T | loop s | chunked s | loop / chunked |", "|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for T in (1, 4, 8, 12, 16, 24, 32, 64, 96):
        x = materialize(benchmark_case(T, 2, 32), device)
        forms = _forms(x)
        for call in forms.values():
            call()
        loop = _timed(forms["loop"], device, args.repeats)[0]
        chunked = _timed(forms["chunked"], device, args.repeats)[0]
        lines.append(f"| {T} | {loop:.3g} | {chunked:.3g} | {loop / chunked:.3g} |")
        print(lines[-1], flush=True)
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device(parser, default="cpu")
    parser.add_argument(
        "--lengths",
        type=typed(parse_lengths),
        default=(2048, 8192, 32768, 131072),
        help="comma-separated sequence lengths (default: 2048,8192,32768,131072)",
    )
    parser.add_argument(
        "--heads", type=typed(lambda t: parse_count("heads", t)), default=16, help="heads (= value heads; default: 16)"
    )
    parser.add_argument(
        "--head-dim", type=typed(lambda t: parse_count("head dim", t)), default=128, help="K = V (default: 128)"
    )
    add_backends(parser, default="none")
    parser.add_argument(
        "--backends",
        dest="backend_list",
        type=lambda text: [x for x in text.split(",") if x],
        default=[],
        help="the same as repeated --backend, comma-separated (fla_chunk,fla_recurrent)",
    )
    parser.add_argument(
        "--repeats",
        type=typed(lambda t: parse_count("repeats", t)),
        default=3,
        help="timed calls per fast contender (median; default: 3)",
    )
    parser.add_argument(
        "--loop-up-to",
        type=typed(lambda t: parse_count("loop-up-to", t, lowest=0)),
        default=0,
        help="skip the token loops above this length (0: never)",
    )
    parser.add_argument("--small", action="store_true", help="only the short-length comparison of the exact forms")
    parser.add_argument("--table", type=Path, default=None, help="also write the table (markdown) to this file")


def execute(args: argparse.Namespace, console: Console) -> int:
    args.backends = [*(args.backends or []), *args.backend_list]
    try:  # options checked before any work: a device that is not there, a backend that is not registered
        args.device = str(resolve_device(args.device))
        for module in args.plugin:
            registry.load_plugin(module)
        unknown = [name for name in args.backends if name not in registry.names()]
    except (ValueError, registry.PluginError) as exc:
        say(console, str(exc), "error:", "red")
        return USAGE
    if unknown:
        say(console, f"--backend: {unknown} unknown; known backends: {', '.join(registry.names())}", "error:", "red")
        return USAGE
    lines = run_small(args) if args.small else run_benchmark(args)
    if args.table is not None:
        atomic_write_text(args.table, f"Produced by `{args.command_line}`\n\n" + "\n".join(lines) + "\n")
    return 0
