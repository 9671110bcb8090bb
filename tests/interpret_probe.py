"""Runs one small Triton computation under the interpreter, with chosen workarounds left out.

``python tests/interpret_probe.py PROBE [SKIP ...]`` prints one JSON line: the
error against the exact answer, or the exception the probe raised. Used by
``test_triton_interpret.py`` in a fresh process per call, since the interpreter
and the patches are process-wide.
"""

from __future__ import annotations

import json
import sys
import warnings

warnings.filterwarnings("ignore")


def main() -> None:
    probe, skip = sys.argv[1], sys.argv[2:]
    from kda_kernels import triton_interpret

    triton_interpret.enable(skip=skip)
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def cast_kernel(x, y, n: tl.constexpr):
        offs = tl.arange(0, n)
        tl.store(y + offs, tl.load(x + offs).to(tl.bfloat16))

    @triton.jit
    def arith_kernel(a, b, y, n: tl.constexpr):
        offs = tl.arange(0, n)
        tl.store(y + offs, tl.load(a + offs) * tl.load(b + offs) + tl.load(a + offs))

    @triton.jit
    def reduce_kernel(x, total, prefix, n: tl.constexpr):
        offs = tl.arange(0, n)
        values = tl.load(x + offs)
        tl.store(total, tl.sum(values, axis=0))
        tl.store(prefix + offs, tl.cumsum(values, axis=0))

    # A Triton builtin called through a module-level alias, as vLLM's and SGLang's kernel copies do.
    globals()["exp2_alias"] = tl.exp2

    @triton.jit
    def alias_kernel(x, y, n: tl.constexpr):
        offs = tl.arange(0, n)
        tl.store(y + offs, exp2_alias(tl.load(x + offs)))  # noqa: F821  (set in globals above)

    @triton.jit
    def doubled(v):
        return v * 2.0

    globals()["doubled"] = doubled  # a device function, found by name as a kernel's globals find it

    @triton.jit
    def device_call_kernel(x, y, n: tl.constexpr):
        offs = tl.arange(0, n)
        tl.store(y + offs, exp2_alias(doubled(doubled(doubled(tl.load(x + offs))))))  # noqa: F821

    @triton.jit
    def dot_kernel(a, b, tf32, ieee, n: tl.constexpr):
        square = tl.arange(0, n)[:, None] * n + tl.arange(0, n)[None, :]
        x, y = tl.load(a + square), tl.load(b + square)
        tl.store(tf32 + square, tl.dot(x, y))  # Triton's default input precision: TF32 on NVIDIA
        tl.store(ieee + square, tl.dot(x, y, input_precision="ieee"))

    gen = torch.Generator().manual_seed(0)
    try:
        if probe == "cast":
            x = torch.randn(1024, generator=gen)
            y = torch.empty(1024, dtype=torch.bfloat16)
            cast_kernel[(1,)](x, y, n=1024)
            result = {"mismatches": int((y != x.to(torch.bfloat16)).sum())}
        elif probe == "arith":
            a = torch.randn(1024, generator=gen).bfloat16()
            b = torch.randn(1024, generator=gen).bfloat16()
            y = torch.empty(1024, dtype=torch.bfloat16)
            arith_kernel[(1,)](a, b, y, n=1024)
            # A GPU rounds after each bf16 operation: the product, then the sum.
            want = ((a.float() * b.float()).bfloat16().float() + a.float()).bfloat16()
            result = {"mismatches": int((y.view(torch.int16) != want.view(torch.int16)).sum())}
        elif probe == "reduce":
            x = torch.randn(64, generator=gen).bfloat16()
            total, prefix = torch.empty(1, dtype=torch.bfloat16), torch.empty(64, dtype=torch.bfloat16)
            reduce_kernel[(1,)](x, total, prefix, n=64)
            # Summed in float32 and rounded once; a GPU's bf16 reduction tree rounds its partial sums too, so
            # its result may differ from this by a bf16 unit or two, not by the garbage of summed bit patterns.
            want_total, want_prefix = x.float().sum(), x.float().cumsum(0)
            result = {
                "total_error": float((total.float() - want_total).abs().max()),
                "prefix_error": float((prefix.float() - want_prefix).abs().max()),
            }
        elif probe == "alias":
            x = torch.randn(64, generator=gen)
            y = torch.empty(64)
            alias_kernel[(1,)](x, y, n=64)
            result = {"max_abs": float((y - torch.exp2(x)).abs().max())}
        elif probe == "patch_once":
            # How often triton.language is patched in two launches of three device calls each (the kernel and
            # its device function in one module), and whether the launch leaves it as it found it.
            from triton.runtime import interpreter

            patch_core, patches = interpreter._patch_lang_core, []

            def counting(lang: object, scope: object) -> object:
                patches.append(lang.__name__)
                return patch_core(lang, scope)

            interpreter._patch_lang_core = counting
            load, mul = tl.load, tl.core.tensor.__mul__
            x = torch.randn(64, generator=gen)
            y = torch.empty(64)
            for _ in range(2):
                device_call_kernel[(1,)](x, y, n=64)
            result = {
                "max_rel": float(((y - torch.exp2(x * 8.0)) / torch.exp2(x * 8.0)).abs().max()),
                "patches": patches,
                "restored": tl.load is load and tl.core.tensor.__mul__ is mul,
            }
        elif probe == "launch_thread":
            # Where a launch runs and what it sees of the caller's thread-local torch modes.
            import threading

            from triton.runtime import interpreter

            seen = []
            set_grid_dim = interpreter.interpreter_builder.set_grid_dim

            def noting(*dims: int) -> None:
                seen.append([threading.current_thread().name, torch.is_inference_mode_enabled()])
                set_grid_dim(*dims)

            interpreter.interpreter_builder.set_grid_dim = noting
            x = torch.randn(64, generator=gen)
            with torch.inference_mode():
                y = torch.empty(64)  # an inference tensor, written by the kernel
                alias_kernel[(1,)](x, y, n=64)
            z = torch.empty(64)
            alias_kernel[(1,)](x, z, n=64)
            want = torch.exp2(x)
            result = {"seen": seen, "max_abs": float(max((y - want).abs().max(), (z - want).abs().max()))}
        elif probe == "tf32_dot":
            # A float32 dot at the default precision and at "ieee" (KDA_INTERPRET_TF32 says how the interpreter
            # takes the first), each against float64 products of the operands as they are, cut and rounded to TF32.
            from kda_reference.chunked import round_to_tf32

            a, b = torch.randn(16, 16, generator=gen), torch.randn(16, 16, generator=gen)
            tf32, ieee = torch.empty(16, 16), torch.empty(16, 16)
            dot_kernel[(1,)](a, b, tf32, ieee, n=16)
            wants = {
                "exact": a.double() @ b.double(),
                "truncated": round_to_tf32(a, truncate=True).double() @ round_to_tf32(b, truncate=True).double(),
                "nearest": round_to_tf32(a).double() @ round_to_tf32(b).double(),
            }
            result = {f"tf32_vs_{name}": float((tf32.double() - want).abs().max()) for name, want in wants.items()}
            result["ieee_vs_exact"] = float((ieee.double() - wants["exact"]).abs().max())
        elif probe in ("chunk_fp32", "chunk_bf16"):
            from kda_cases.case import Case
            from kda_cases.materialize import materialize
            from kda_kernels.backends.fla import FlaChunk
            from kda_reference.run import run_reference

            case = Case(seq_lens=(37,), dtype=probe.split("_")[1], initial_state="random")
            inputs = materialize(case)
            out = FlaChunk().run(inputs)
            ref = run_reference(inputs)
            result = {"max_abs": float((out.o.double() - ref.o).abs().max())}
        else:
            raise SystemExit(f"unknown probe {probe}")
    except Exception as exc:
        result = {"exception": f"{type(exc).__name__}: {exc}"[:300]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
