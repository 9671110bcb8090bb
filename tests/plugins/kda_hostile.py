"""Hostile backends: each the correct baseline but for one way of breaking its call's contract (writing
into its inputs, returning memory it does not own or something that is not its output, ending the process,
raising where it must answer), or a NaN state at the first step of a multi-step check. The suite must
charge each to itself, leave every other backend's verdict as it would be alone, and keep its store
loadable. ``kda_hostile_baseline`` (a module of its own) replaces the baseline."""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import signal
import sys
import tempfile

import torch
from torch.overrides import TorchFunctionMode

from kda_cases.case import Case
from kda_cases.dtypes import INT_OF_SIZE
from kda_cases.materialize import KDAInputs
from kda_kernels.protocol import BackendOutput, Support
from kda_kernels.registry import register
from kda_kernels.torch_chunk import TorchChunk

# name -> (the verdict it must get, words its reason must hold), for tests/test_hostile.py
EXPECTED: dict[str, tuple[str, str]] = {}


def hostile(name: str, verdict: str, reason: str):
    def add(cls: type) -> type:
        cls.name = name
        EXPECTED[name] = (verdict, reason)
        register(name, cls, replace=True)
        return cls

    return add


def _right_then(inputs: KDAInputs, spoil) -> BackendOutput:
    """The correct answer, computed before ``spoil(inputs)`` writes into the inputs: a backend that passes
    itself and would fail whoever runs after it on the same inputs."""
    out = TorchChunk().run(inputs)
    spoil(inputs)
    return out


# One backend per input it writes into, after computing the right answer (hostile_writes_q, ...). Where a
# case lacks the input (no initial state, no cu_seqlens), it writes q instead.
WRITTEN_INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens")


def _writes(input_name: str) -> type:
    def spoil(inputs: KDAInputs) -> None:
        tensor = getattr(inputs, input_name)
        tensor = inputs.q if tensor is None else tensor
        tensor.view(-1)[-1:].add_(1)  # the last element: the first changed one is then the one it wrote

    class Writes(TorchChunk):
        def run(self, inputs: KDAInputs) -> BackendOutput:
            return _right_then(inputs, spoil)

    return hostile(f"hostile_writes_{input_name}", "fail", "wrote into its input")(Writes)


for written in WRITTEN_INPUTS:
    _writes(written)


@hostile("hostile_returns_an_input", "fail", "sharing memory with its input v")
class ReturnsAnInput(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        return dataclasses.replace(out, o=inputs.v)  # v has o's shape: a view of the caller's tensor


@hostile("hostile_os_exit", "error", "called os._exit(0)")
class CallsOsExit(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        os._exit(0)


@hostile("hostile_system_exit", "error", "raised SystemExit(0)")
class RaisesSystemExit(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        raise SystemExit(0)


@hostile("hostile_returns_none", "error", "returned NoneType, not a BackendOutput")
class ReturnsNone(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        return None


@hostile("hostile_returns_a_tuple", "error", "returned a tuple of 2, not a BackendOutput")
class ReturnsATuple(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        return (out.o, out.final_state)


@hostile("hostile_returns_meta", "error", "returned o on the meta device")
class ReturnsMeta(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        return dataclasses.replace(out, o=torch.empty_like(out.o, device="meta"))


@hostile("hostile_raises_in_supports", "error", "raised RuntimeError in supports")
class RaisesInSupports(TorchChunk):
    def supports(self, case: Case) -> Support:
        raise RuntimeError("no envelope today")


@hostile("hostile_raises_in_availability", "error", "raised RuntimeError in availability")
class RaisesInAvailability(TorchChunk):
    def availability(self, device: torch.device) -> Support:
        raise RuntimeError("driver probe crashed")


@hostile("hostile_sets_default_dtype", "fail", "changed torch's default dtype from torch.float32 to torch.float64")
class SetsDefaultDtype(TorchChunk):
    """Right, but leaves torch's default dtype float64: later cases were drawn otherwise, limits 2.4x tighter."""

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        torch.set_default_dtype(torch.float64)
        return out


@hostile(
    "hostile_sets_new_matmul_precision",
    "fail",
    "changed torch.backends.mkldnn.matmul.fp32_precision from 'none' to 'bf16'",
)
class SetsNewMatmulPrecision(TorchChunk):
    """Right, but leaves oneDNN's float32 matmuls in bf16 by torch's newer switch: torch's legacy getter then
    raised for everyone after, and every later baseline was a (suite) error."""

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        return out


@hostile("hostile_changes_directory", "fail", "changed the working directory from")
class ChangesDirectory(TorchChunk):
    """Right, but leaves the process in another folder: a run's relative store moved under it."""

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        os.chdir(tempfile.gettempdir())
        return out


@hostile("hostile_lowers_recursion_limit", "fail", "changed the recursion limit from")
class LowersRecursionLimit(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        sys.setrecursionlimit(max(sys.getrecursionlimit() // 2, 400))
        return out


@hostile("hostile_ignores_sigterm", "fail", "changed the handler of SIGTERM")
class IgnoresSigterm(TorchChunk):
    """Right, but ignores SIGTERM from then on: a CI job's time limit could no longer stop the run."""

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return out


@hostile("hostile_mutates_the_case", "fail", "changed the Case it was handed (seq_lens; put back)")
class MutatesTheCase(TorchChunk):
    """Right, but rewrites the frozen Case it was handed: every later backend would be judged on another."""

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        object.__setattr__(inputs.case, "seq_lens", tuple(n + 1 for n in inputs.case.seq_lens))
        return out


class _NoisyMatmul(TorchFunctionMode):
    """Every matmul 1e-3 off: left open, the suite's truth and baseline computed through it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.einsum):
            return result + 1e-3
        return result


@hostile("hostile_leaves_a_function_mode", "fail", "left _NoisyMatmul on torch's function-mode stack")
class LeavesAFunctionMode(TorchChunk):
    """Right, but enters a TorchFunctionMode and never leaves it: every later torch call goes through it."""

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        _NoisyMatmul().__enter__()
        return out


@hostile("hostile_wraps_torch_matmul", "fail", ", which the suite computes with (")
class WrapsTorchMatmul(TorchChunk):
    """Right, but wraps torch.matmul and the @ operator 1e-3 off for everyone after it (the baseline moved
    1.9e3 times its limit, and the patcher was never named)."""

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        real_matmul, real_operator = torch.matmul, torch.Tensor.__matmul__
        torch.matmul = lambda a, b, **kw: real_matmul(a, b, **kw) + 1e-3
        torch.Tensor.__matmul__ = lambda a, b: real_operator(a, b) + 1e-3
        return out


@hostile("hostile_turns_grad_mode", "fail", "changed torch's grad mode from")
class TurnsGradMode(TorchChunk):
    """Right, but flips torch's grad mode for everyone after it (a gradient check would see none)."""

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        torch.set_grad_enabled(not torch.is_grad_enabled())
        return out


@hostile("hostile_closes_stdout", "fail", "closed sys.stdout (a fresh one on its file descriptor put in its place)")
class ClosesStdout(TorchChunk):
    """Right, but closes sys.stdout: the run could print nothing more (its summary, its repro lines)."""

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        sys.stdout.close()
        return out


@hostile("hostile_closes_standard_error", "fail", "closed file descriptor 2 (standard error; put back)")
class ClosesStandardError(TorchChunk):
    """Right, but closes file descriptor 2: every later warning and traceback would go nowhere."""

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        os.close(2)
        return out


@hostile("hostile_sets_suite_variable", "fail", "set the suite's variable KDA_REFERENCE_FORM (removed)")
class SetsSuiteVariable(TorchChunk):
    """Right, but switches the truth's form for every later case."""

    sets_environment = ("KDA_REFERENCE_FORM",)  # declared, but a suite variable is never a backend's to set

    def run(self, inputs: KDAInputs) -> BackendOutput:
        os.environ["KDA_REFERENCE_FORM"] = "loop"
        return super().run(inputs)


@hostile("hostile_sets_a_variable", "fail", "set the environment variable HOSTILE_FAST_MATH (removed); a backend")
class SetsAVariable(TorchChunk):
    """Right, but leaves a library switch set that it never declared (as a library setting TRITON_F32_DEFAULT
    at import changes every later Triton kernel's fp32 dots)."""

    def run(self, inputs: KDAInputs) -> BackendOutput:
        os.environ["HOSTILE_FAST_MATH"] = "1"
        return super().run(inputs)


class SetsADeclaredVariable(TorchChunk):
    """Right, and sets a variable it declares: kept, no failure."""

    name = "hostile_sets_a_declared_variable"
    sets_environment = ("HOSTILE_DECLARED_SWITCH",)

    def run(self, inputs: KDAInputs) -> BackendOutput:
        os.environ["HOSTILE_DECLARED_SWITCH"] = "on"
        return super().run(inputs)


register(SetsADeclaredVariable.name, SetsADeclaredVariable, replace=True)


@hostile("hostile_replaces_the_baseline", "fail", "replaced the suite's kda_kernels.torch_chunk.TorchChunk.run")
class ReplacesTheBaseline(TorchChunk):
    """Right, but replaces the baseline's run with one 1e-3 off: every later limit loosened (2.2x seen)."""

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = TorchChunk.run(self, inputs)
        real = TorchChunk.run

        def loose(backend: TorchChunk, given: KDAInputs) -> BackendOutput:
            result = real(backend, given)
            return dataclasses.replace(result, o=result.o + 1e-3)

        TorchChunk.run = loose
        return out


@hostile("hostile_replaces_the_reference", "fail", "replaced the suite's kda_conformance.running.truth.run_reference")
class ReplacesTheReference(TorchChunk):
    """Right, but replaces the float64 reference the suite's truths are computed with by a zero answer."""

    def run(self, inputs: KDAInputs) -> BackendOutput:
        truth_module = sys.modules["kda_conformance.running.truth"]
        real = truth_module.run_reference

        def zero(given: KDAInputs, form: str = "auto"):
            result = real(given, form)
            return dataclasses.replace(result, o=torch.zeros_like(result.o))

        truth_module.run_reference = zero
        return super().run(inputs)


@hostile("hostile_overwrites_the_truth", "fail", "changed the suite's float64 truth of case")
class OverwritesTheTruth(TorchChunk):
    """Finds the float64 truth of its case (gc), zeroes it and answers zeros: it passed itself, and the
    backend after it failed."""

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        for held in gc.get_objects():
            if type(held).__name__ == "CaseTruth" and getattr(held, "inputs", None) is inputs:
                held.reference.o.zero_()
        return dataclasses.replace(out, o=torch.zeros_like(out.o))


class ReusesItsOutputBuffer(TorchChunk):
    """Returns one buffer it keeps, written afresh on every call with the answer and a last-bit noise: two
    calls' outputs are the same tensor, so a repeat compared with the first saw no difference."""

    name = "hostile_reuses_its_output_buffer"

    def __init__(self) -> None:
        super().__init__()
        self.buffer: torch.Tensor | None = None
        self.calls = 0

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        if self.buffer is None or self.buffer.shape != out.o.shape:
            self.buffer = torch.empty_like(out.o)
        self.calls += 1
        self.buffer.copy_(out.o)
        self.buffer.view(INT_OF_SIZE[out.o.element_size()])[0, 0, 0, 0] ^= self.calls % 2
        return dataclasses.replace(out, o=self.buffer)


register(ReusesItsOutputBuffer.name, ReusesItsOutputBuffer, replace=True)


class Lying(torch.Tensor):
    """A tensor whose subtraction says there is no difference."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.sub, torch.Tensor.__sub__, torch.sub):
            return torch.zeros_like(torch.Tensor.as_subclass(args[0], torch.Tensor)).double()
        return super().__torch_function__(func, types, args, kwargs or {})


@hostile("hostile_returns_a_lying_subclass", "fail", "max_abs")
class ReturnsALyingSubclass(TorchChunk):
    """Wrong by 1 everywhere, in a tensor subclass whose subtraction returns zeros (max-abs 0 before)."""

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        return dataclasses.replace(out, o=(out.o + 1).as_subclass(Lying))


# One exception object raised again on every call, by two backends (an adapter that caches its import error).
CACHED_IMPORT_ERROR = ImportError("no module named kernel_ext (cached at import)")


@hostile("hostile_cached_error_a", "error", "ImportError: no module named kernel_ext")
class CachedErrorA(TorchChunk):
    def run(self, inputs: KDAInputs) -> BackendOutput:
        raise CACHED_IMPORT_ERROR


@hostile("hostile_cached_error_b", "error", "ImportError: no module named kernel_ext")
class CachedErrorB(CachedErrorA):
    pass


class Unprintable(RuntimeError):
    def __str__(self) -> str:
        raise ValueError("no message today")


@hostile("hostile_raises_unprintable", "error", "Unprintable: <its message could not be read: str() raised ValueError>")
class RaisesUnprintable(TorchChunk):
    """Raises an exception whose str() raises in turn: it was charged to the suite, the backend got no row."""

    def run(self, inputs: KDAInputs) -> BackendOutput:
        raise Unprintable


@hostile("hostile_raises_keyboard_interrupt", "error", "raised KeyboardInterrupt during its call with no interrupt")
class RaisesKeyboardInterrupt(TorchChunk):
    """Raises KeyboardInterrupt itself (a library's own handler re-raising it, say): no one pressed Ctrl-C."""

    def run(self, inputs: KDAInputs) -> BackendOutput:
        raise KeyboardInterrupt


@hostile("hostile_raises_a_surrogate", "error", "no such file: kernel-\\udcff.bin")
class RaisesASurrogate(TorchChunk):
    """Raises with a name os.fsdecode made of bytes that are not UTF-8: a lone surrogate in the message."""

    def run(self, inputs: KDAInputs) -> BackendOutput:
        name = os.fsdecode(b"kernel-\xff.bin")
        raise FileNotFoundError(f"no such file: {name}")


@hostile("hostile_nan_state_at_step_one", "fail", "non-finite")
class NanStateWhenFresh(TorchChunk):
    """Right but for a NaN final state of every call without an initial state: the first step of a
    two-step prefill (its second step would resume from the NaN)."""

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        if inputs.initial_state is not None:
            return out
        return dataclasses.replace(out, final_state=torch.full_like(out.final_state, float("nan")))


# A death no exception survives: the process ends inside the call (subprocess tests only; a segfault is
# kda_planted_crashes's planted_segfault).
class Aborts(TorchChunk):
    name = "hostile_abort"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        os.abort()


register(Aborts.name, Aborts, replace=True)


# Backends that fork: each correct, so each must pass, with one row per record and a run that exits. A child
# forked inside a call inherited the suite's exit trap and became a second copy of the sweep (the run never
# ended, or one case held the same backend as both error and pass); a daemonic isolated worker could not
# start a pool at all.
class ForksAPool(TorchChunk):
    """Asks a forked multiprocessing pool for a number, as a backend with host-side workers might."""

    name = "hostile_forks_a_pool"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        with multiprocessing.get_context("fork").Pool(1) as pool:
            assert pool.apply(abs, (-3,)) == 3
        return super().run(inputs)


class ForksAndExits(TorchChunk):
    """``os.fork()``; the child ends with ``os._exit(0)`` at once."""

    name = "hostile_forks_and_exits"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        child = os.fork()
        if child == 0:
            os._exit(0)
        os.waitpid(child, 0)
        return super().run(inputs)


class ForksAndReturns(TorchChunk):
    """``os.fork()``; the child returns from the call (None) as if it were the suite's process."""

    name = "hostile_forks_and_returns"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        child = os.fork()
        if child == 0:
            return None
        os.waitpid(child, 0)
        return super().run(inputs)


FORKING = (ForksAPool.name, ForksAndExits.name, ForksAndReturns.name)
for forking in (ForksAPool, ForksAndExits, ForksAndReturns):
    register(forking.name, forking, replace=True)
