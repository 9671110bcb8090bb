"""Workarounds that let FLA's Triton kernels, and servers' copies of them, run on a CPU (``TRITON_INTERPRET=1``).

The Triton interpreter executes kernels with NumPy. For the KDA kernels it has
six gaps, each patched here and each covered by a test in
``tests/test_triton_interpret.py`` that fails both when the workaround stops
working and when the interpreter no longer needs it, and two costs (7, 8), timed
by a benchmark instead:

1. ``autotune``: the autotuner benchmarks every config on a GPU driver, which a
   CPU does not have ("0 active drivers"). We keep only the first config.
2. ``loop_index``: ``for i in range(n)`` yields Python ints in the interpreter and
   FLA calls ``i.to(tl.int64)`` on them. FLA modules get a ``range`` whose items
   are ints with a ``to`` method.
3. ``bf16_arith``: bf16 values are stored as raw ``uint16``; elementwise ops and
   ``tl.dot`` then compute on the bit patterns. We decode to fp32, compute, and
   round back.
4. ``bf16_reduce``: reductions and scans (``tl.sum``, ``tl.cumsum``...) run numpy on
   the same raw bits (FLA's bf16 backward then read dg off by more than its size
   from an initial state's gradient). We decode, reduce, and round back.
5. ``bf16_round``: fp32 -> bf16 casts truncate; a GPU rounds to nearest even.
6. ``builtin_alias``: the interpreter patches Triton's builtins on ``tl`` only,
   so a kernel calling one through a module-level alias fails ("Did you forget
   to add @triton.jit ?"): FLA's ``gather = tl.gather`` (safe-gate path),
   vLLM's and SGLang's ``exp2 = tl.exp2``. We patch such aliases in the
   kernel's module for the length of each launch (FLA's own ``gather`` then
   runs, where an earlier workaround switched FLA to its ``tl.load`` fallback).
   The loop-index patch (2) is also applied to a vendored tree's modules
   (:func:`patch_loop_index`, called by kernels/backends/vendored.py).
7. ``shallow_stack``: not a gap but a cost, of CPython 3.11. Its frames live in
   16 KiB chunks, mapped when a call crosses into a new one and unmapped when
   it returns; the interpreter's millions of small calls, from a stack as deep
   as pytest's, crossed one such boundary back and forth: 1.8 million maps and
   as many unmaps (strace) in examples/test_kda_like_fla.py::test_chunk. Each
   launch runs on a thread of its own, whose stack starts empty, with the
   caller's grad and inference modes; the caller waits for it. FLA's two chunk
   tests there took 19.5 s with it and 55.4 s without, 31.4 s of them system
   time (``python tests/interpreter_bench.py``, medians of 3, 2 cores).
8. ``patch_once``: a cost. The interpreter patches ``triton.language`` again at
   every device-function call, though a launch's patches stay until it ends
   (8.5 of test_chunk's 40 s under cProfile). Within one launch it is patched
   once for each module whose functions run (the launch's own patch first, the
   one restored at its end). FLA's two chunk tests: 14.8 s with it, 20.7 s
   without, both with (7) (``python tests/interpreter_bench.py --leave-out
   patch_once``, medians of 3, A/B 0.714).

One option is not a workaround but an emulation: ``KDA_INTERPRET_TF32`` (:data:`TF32_VARIABLE`) makes the
interpreter's TF32 dots take their float32 operands as an NVIDIA GPU does. A ``tl.dot`` of float32 operands at
input precision ``tf32`` (Triton's default on NVIDIA, where ``TRITON_F32_DEFAULT`` is unset) is computed by
the interpreter in full float32; with ``truncated`` its operands are first cut to TF32 (the low 13 mantissa
bits dropped, as Triton hands float32 registers to the tensor cores), with ``nearest`` rounded to it (ties to
even); unset or ``ieee`` leaves them. It lets a CPU reproduce what TF32 dots cost on a GPU: FLA's chunk
backward on T2016x4 bf16 (reset gates, large inputs) measured dA_log 0.81 off on an H100, 0.64 off in the
interpreter with ``truncated`` and 0.0078 without; dg's max-abs error was 3.677e-3 on the H100 and with
``truncated``, 3.470e-3 without (docs/testing.md).

Everything is switched on by :func:`enable`, called by the pytest plugin and the
FLA adapters on a CPU: the Triton patches at once, the one that patches FLA's own
modules (2) as soon as ``fla.ops.kda`` has been imported, whoever imports it, so
that a process that runs no FLA kernel never pays FLA's import (seconds).
The patches are written against one Triton release (:data:`PINNED_TRITON`); a
different release refuses them with a clear error, since the interpreter
internals they touch are private.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import types
import warnings
from collections.abc import Callable, Collection, Iterator

PINNED_TRITON = "3.9.0"
VARIABLE = "TRITON_INTERPRET"  # set by enable(): a backend that may enable the interpreter declares it
WORKAROUNDS = (
    "autotune",
    "loop_index",
    "bf16_arith",
    "bf16_reduce",
    "bf16_round",
    "builtin_alias",
    "patch_once",
    "shallow_stack",
)

# The emulation of TF32 dots (module docstring): the variable and the values it takes ("" is "ieee").
TF32_VARIABLE = "KDA_INTERPRET_TF32"
TF32_MODES = ("ieee", "truncated", "nearest")

_enabled = False
_fla_pending: tuple[str, ...] = ()  # the FLA workarounds enable() left for patch_fla()
_skipped: frozenset[str] = frozenset()  # the workarounds enable() was told to leave out


class TritonInterpretError(RuntimeError):
    """The CPU interpreter path cannot be set up in this environment."""


class _LoopIndex(int):
    """An int that accepts Triton's ``.to(dtype)``, as a loop index does on a GPU."""

    def to(self, *_args: object, **_kwargs: object) -> int:
        return int(self)


def _loop_range(*args: int) -> Iterator[int]:
    return (_LoopIndex(i) for i in range(*args))


def interpreting() -> bool:
    """Whether Triton runs kernels in its NumPy interpreter in this process."""
    return os.environ.get(VARIABLE, "0") not in ("", "0")


def problem() -> str:
    """Why the interpreter path cannot be used in this process, or '' when it can.

    Checked without importing triton: importing it before ``TRITON_INTERPRET`` is
    set makes ``@triton.jit`` functions compiled ones, which the interpreter then
    refuses to call ("Cannot call @triton.jit'd outside of the scope of a kernel").
    """
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return f"triton is not installed; the CPU path needs triton=={PINNED_TRITON}"
    if version != PINNED_TRITON:
        return (
            f"the CPU interpreter workarounds are written for triton=={PINNED_TRITON}, found "
            f"triton=={version}; install triton=={PINNED_TRITON} to run FLA kernels on a CPU"
        )
    if not _enabled and not interpreting():
        early = [name for name in ("triton", "fla") if name in sys.modules]
        if early:
            return (
                f"{' and '.join(early)} was imported before the Triton interpreter was switched on; "
                "run CPU cases in a fresh process (or set TRITON_INTERPRET=1 before importing them)"
            )
    return ""


def enable(skip: Collection[str] = ()) -> None:
    """Switch this process to the Triton interpreter and apply the workarounds.

    Must run before ``triton`` or ``fla`` is first imported (see :func:`problem`).
    ``skip`` leaves named workarounds out; the suite's own tests use it to show
    that each one is still needed.
    """
    global _enabled
    unknown = set(skip) - set(WORKAROUNDS)
    if unknown:
        raise ValueError(f"unknown workarounds {sorted(unknown)}; known: {', '.join(WORKAROUNDS)}")
    if _enabled:
        return
    reason = problem()
    if reason:
        raise TritonInterpretError(reason)
    tf32_mode()  # a bad value is refused before anything is patched
    os.environ[VARIABLE] = "1"
    # Noise of the CPU path, not findings: FLA warns that it "rolls back to CPU", and the
    # interpreter evaluates exp and exp2 on masked-off lanes, whose overflow the kernel discards.
    warnings.filterwarnings("ignore", message="Triton is not supported on current platform", category=UserWarning)
    warnings.filterwarnings("ignore", message="overflow encountered in exp", category=RuntimeWarning)
    global _skipped
    _skipped = frozenset(skip)
    for name, patch in TRITON_PATCHES.items():
        if name not in skip:
            patch()
    _patch_tf32_dots()
    global _fla_pending
    _fla_pending = tuple(name for name in FLA_PATCHES if name not in skip)
    _enabled = True
    if "fla.ops.kda" in sys.modules:  # FLA came in with TRITON_INTERPRET set already: patch it now
        patch_fla()
    elif _fla_pending:
        sys.meta_path.insert(0, _PatchFlaOnImport())


class _PatchFlaOnImport(importlib.abc.MetaPathFinder):
    """Applies the FLA workarounds as soon as ``fla.ops.kda`` has been imported, by whatever code imports it
    (a standalone repro file, say), and then leaves ``sys.meta_path``."""

    def find_spec(self, name: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name != "fla.ops.kda":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_then_patch(module: types.ModuleType) -> None:
            load(module)
            patch_fla()

        spec.loader.exec_module = exec_then_patch  # this spec's own loader, for this one import
        return spec


def patch_fla() -> None:
    """Apply the workarounds that patch FLA's own modules, once, after ``fla.ops.kda`` is imported (FLA's
    adapter calls it). They wait for FLA because importing it takes seconds (torch's compiler stack with it):
    a process that runs no FLA kernel, a pytest worker of the baseline alone say, never pays for it."""
    global _fla_pending
    pending, _fla_pending = _fla_pending, ()
    for name in pending:
        FLA_PATCHES[name]()


def _patch_autotune() -> None:
    from triton.runtime.autotuner import Autotuner

    original_run = Autotuner.run

    def run_first_config(self, *args, **kwargs):
        if len(self.configs) > 1:
            self.configs = self.configs[:1]
        return original_run(self, *args, **kwargs)

    run_first_config.__wrapped__ = original_run  # Triton's own, for a test of autotuning itself
    Autotuner.run = run_first_config


def _to_f32(data):
    import numpy as np

    return (data.astype(np.uint32) << 16).view(np.float32)


def _to_bf16(data):
    """fp32 -> bf16 bits, round to nearest even, NaN kept a quiet NaN (a GPU's cvt.rn.bf16.f32)."""
    import numpy as np

    f32 = np.ascontiguousarray(data, dtype=np.float32)
    bits = f32.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    return np.where(np.isnan(f32), np.uint32(0x7FC0), rounded).astype(np.uint16)


def _is_bf16(handle: object) -> bool:
    """Whether an interpreter tensor handle holds bf16 values as their raw bits (numpy has no bf16)."""
    import numpy as np
    import triton.language as tl

    return handle.dtype.scalar == tl.bfloat16 and handle.data.dtype == np.uint16  # type: ignore[attr-defined]


def _decoded(handle):
    """A bf16 handle as float32 values; any other as it is."""
    import triton.language as tl
    from triton.runtime import interpreter as interp

    return interp.TensorHandle(_to_f32(handle.data), tl.float32) if _is_bf16(handle) else handle


def _encoded(result):
    """A float32 handle rounded to bf16 bits; any other as it is."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    if result.dtype.scalar == tl.float32 and result.data.dtype == np.float32:
        return interp.TensorHandle(_to_bf16(result.data), tl.bfloat16)
    return result


def _patch_bf16_arith() -> None:
    import numpy as np
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    is_bf16, decoded, encoded = _is_bf16, _decoded, _encoded

    original_binary = builder.binary_op
    original_unary = builder.unary_op
    original_ternary = builder.ternary_op
    original_dot = builder.create_dot
    original_fma = builder.create_fma

    def binary_op(self, lhs, rhs, op):
        if is_bf16(lhs) or is_bf16(rhs):
            return encoded(original_binary(self, decoded(lhs), decoded(rhs), op))
        return original_binary(self, lhs, rhs, op)

    def unary_op(self, arg, op):
        if is_bf16(arg):
            return encoded(original_unary(self, decoded(arg), op))
        return original_unary(self, arg, op)

    def ternary_op(self, lhs, rhs, other, op):
        # np.where on raw bits is a correct select; np.clip on raw bits is not.
        if op is np.clip and is_bf16(lhs):
            return encoded(original_ternary(self, decoded(lhs), decoded(rhs), decoded(other), op))
        return original_ternary(self, lhs, rhs, other, op)

    def create_fma(self, x, y, z):
        if is_bf16(z):
            return encoded(original_fma(self, decoded(x), decoded(y), decoded(z)))
        return original_fma(self, x, y, z)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        # A GPU multiplies bf16 operands exactly and accumulates in d's type (fp32).
        return original_dot(self, decoded(a), decoded(b), d, input_precision, max_num_imprecise_acc)

    builder.binary_op = binary_op
    builder.unary_op = unary_op
    builder.ternary_op = ternary_op
    builder.create_fma = create_fma
    builder.create_dot = create_dot


def _patch_bf16_reduce() -> None:
    """Reductions and scans (``tl.sum``, ``tl.max``, ``tl.cumsum`` and their generic forms) run numpy on the
    handles' data: on bf16 they summed the bit patterns. They compute on the decoded values and round back."""
    import triton.language as tl
    from triton.runtime import interpreter as interp

    def retyped(x: tl.core.tensor, handle: interp.TensorHandle) -> tl.core.tensor:
        kind = handle.dtype.scalar
        return tl.core.tensor(handle, tl.block_type(kind, list(x.shape)) if x.type.is_block() else kind)

    original_apply = interp.ReduceScanOpInterface.apply

    def apply(self, input):
        if not isinstance(input, tuple):
            return apply(self, (input,))[0]
        wide = [_is_bf16(x.handle) for x in input]
        if not any(wide):
            return original_apply(self, input)
        done = original_apply(
            self, tuple(retyped(x, _decoded(x.handle)) if w else x for x, w in zip(input, wide, strict=True))
        )
        # Output n is input n's reduction (an index beside a value is int32, left alone).
        return tuple(retyped(y, _encoded(y.handle)) if n < len(wide) and wide[n] else y for n, y in enumerate(done))

    interp.ReduceScanOpInterface.apply = apply


def _patch_bf16_round() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    original_cast = builder.cast_impl
    original_fp_to_fp = builder.create_fp_to_fp

    def cast_impl(self, src, dst_type):
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar != tl.bfloat16:
            return interp.TensorHandle(_to_bf16(src.data.astype(np.float32)), tl.bfloat16)
        return original_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar == tl.float32:
            return cast_impl(self, src, dst_type)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp
    for name in ("create_si_to_fp", "create_ui_to_fp", "create_fp_ext", "create_fp_trunc"):
        setattr(builder, name, lambda self, src, dst_type: cast_impl(self, src, dst_type))


def _patch_loop_index() -> None:
    import fla.ops.kda  # noqa: F401  (loads every module the KDA entry points use)

    patch_loop_index("fla")


def patch_loop_index(package: str) -> None:
    """Loop indices with Triton's ``.to`` in every loaded module of ``package`` (FLA, a server's tree)."""
    if "loop_index" in _skipped:
        return
    for name, module in list(sys.modules.items()):
        if (name == package or name.startswith(package + ".")) and isinstance(module, types.ModuleType):
            module.range = _loop_range


def _patch_builtin_aliases() -> None:
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    patch_lang = interpreter._patch_lang

    def patch_lang_and_aliases(fn: Callable) -> object:
        scope = patch_lang(fn)
        module = sys.modules.get(fn.__module__)
        if module is None:
            return scope
        for name, value in list(fn.__globals__.items()):
            if tl.core.is_builtin(value):

                def with_semantic(*args: object, _member: Callable = value, **kwargs: object) -> object:
                    kwargs.pop("_semantic", None)
                    return _member(*args, **kwargs, _semantic=interpreter.interpreter_semantic)

                scope.set_attr(module, name, with_semantic)  # restored with the rest after the launch
        return scope

    interpreter._patch_lang = patch_lang_and_aliases


def _patch_launch_on_a_shallow_stack() -> None:
    import threading

    from triton.runtime import interpreter

    launch = interpreter.GridExecutor.__call__

    def launch_on_a_thread(self: object, *args: object, **kwargs: object) -> object:
        import torch

        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()  # both are per thread
        outcome: dict[str, object] = {}

        def run() -> None:
            try:
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    outcome["value"] = launch(self, *args, **kwargs)
            except BaseException as exc:  # the caller's to raise, with the kernel's traceback
                outcome["error"] = exc

        # A daemon: a caller interrupted while it waits (Ctrl-C, a time limit) does not wait on at exit.
        thread = threading.Thread(target=run, name="triton-interpreter-launch", daemon=True)
        thread.start()
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value")

    interpreter.GridExecutor.__call__ = launch_on_a_thread


def _patch_lang_once_a_launch() -> None:
    import threading

    from triton.runtime import interpreter

    launch, patch_lang = interpreter.GridExecutor.__call__, interpreter._patch_lang
    state = threading.local()

    def launch_fresh(self: object, *args: object, **kwargs: object) -> object:
        before, state.patched = getattr(state, "patched", None), set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.patched = before

    def patch_once(fn: Callable) -> object:
        # The launch's own call comes first and always patches: its scope is the one restored at the launch's end.
        patched = getattr(state, "patched", None)
        if patched is not None and fn.__module__ in patched:
            return interpreter._LangPatchScope()  # nothing to restore: the launch's patches still stand
        if patched is not None:
            patched.add(fn.__module__)
        return patch_lang(fn)

    interpreter.GridExecutor.__call__ = launch_fresh
    interpreter._patch_lang = patch_once


def tf32_mode() -> str:
    """How the interpreter's TF32 dots take float32 operands, from ``KDA_INTERPRET_TF32``: ``ieee`` (unset),
    ``truncated`` or ``nearest`` (module docstring); any other value is refused, naming the variable."""
    mode = os.environ.get(TF32_VARIABLE, "").strip().lower() or "ieee"
    if mode not in TF32_MODES:
        raise TritonInterpretError(
            f"{TF32_VARIABLE}={os.environ[TF32_VARIABLE]!r} is not a way to take TF32 dots' operands; "
            f"allowed: {', '.join(TF32_MODES)} (unset: ieee)"
        )
    return mode


def _patch_tf32_dots() -> None:
    """Read ``KDA_INTERPRET_TF32`` at each dot, so that a test may switch it within one process."""
    import numpy as np
    import torch
    from triton.runtime import interpreter as interp

    from kda_reference.chunked import round_to_tf32

    builder = interp.InterpreterBuilder
    original_dot = builder.create_dot

    def cut(handle: interp.TensorHandle, truncate: bool) -> interp.TensorHandle:
        if handle.data.dtype != np.float32:  # bf16 and fp16 operands fit TF32 as they are
            return handle
        data = round_to_tf32(torch.from_numpy(np.ascontiguousarray(handle.data)), truncate=truncate).numpy()
        return interp.TensorHandle(data, handle.dtype)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        mode = tf32_mode()
        if mode != "ieee" and str(input_precision).rsplit(".", 1)[-1] == "TF32":
            truncate = mode == "truncated"
            a, b = cut(a, truncate), cut(b, truncate)
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot


def _patch_safe_gate_precision() -> None:
    """FLA's safe-gate backward asks its diagonal dots for ``bf16x3`` on Triton 3.6 and later, a precision the
    interpreter's dot refuses (it takes tf32, tf32x3 and ieee); the interpreter computes every dot in numpy's
    float32 whatever it is asked, so ``ieee`` is what it computes anyway."""
    import fla.ops.kda.chunk_intra as intra
    import triton.language as tl

    if getattr(intra, "SAFE_GATE_DOT_PRECISION", None) is not None:
        intra.SAFE_GATE_DOT_PRECISION = tl.constexpr("ieee")


# The workarounds by what they patch: Triton itself (applied by enable()) and FLA's modules (patch_fla()).
TRITON_PATCHES = {
    "autotune": _patch_autotune,
    "bf16_arith": _patch_bf16_arith,
    "bf16_reduce": _patch_bf16_reduce,
    "bf16_round": _patch_bf16_round,
    "builtin_alias": _patch_builtin_aliases,
    "patch_once": _patch_lang_once_a_launch,
    "shallow_stack": _patch_launch_on_a_shallow_stack,
}
FLA_PATCHES = {"loop_index": _patch_loop_index, "safe_gate_precision": _patch_safe_gate_precision}
