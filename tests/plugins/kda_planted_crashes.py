"""Backends that fail the way real GPUs fail (for the fault tests; never in the zoo, which runs in one
process): a segfault, a hang, a sticky device error, running out of memory, and a correct backend that
fails its cases only when told to (for the regression tests of a night split over workers), and one that
raises the message it is told to (for the ledger's errors)."""

from __future__ import annotations

import os
import signal
import time

import torch

from kda_cases.materialize import KDAInputs
from kda_kernels.protocol import BackendOutput
from kda_kernels.registry import register
from kda_kernels.torch_chunk import TorchChunk

STICKY_MESSAGE = "CUDA error: an illegal memory access was encountered"


class Segfault(TorchChunk):
    name = "planted_segfault"
    description = "dies of SIGSEGV, as a kernel's illegal memory access takes its process down"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        os.kill(os.getpid(), signal.SIGSEGV)
        raise AssertionError("unreachable")


class Hang(TorchChunk):
    name = "planted_hang"
    description = "never returns, as a kernel spinning on a barrier"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        time.sleep(3600)
        raise AssertionError("unreachable")


class StickyFault(TorchChunk):
    name = "planted_sticky_fault"
    description = "raises CUDA's sticky illegal-address error, after which nothing may run in the process"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        raise RuntimeError(STICKY_MESSAGE)


class CrashesOnBf16(TorchChunk):
    name = "planted_bf16_crash"
    description = (
        "the baseline, but every bf16 call raises CUDA's sticky misaligned-address error (one crashing set of "
        "kernel configurations); each launch is logged to KDA_LAUNCH_LOG"
    )

    def run(self, inputs: KDAInputs) -> BackendOutput:
        log = os.environ.get("KDA_LAUNCH_LOG")
        if log:
            with open(log, "a") as handle:
                handle.write(f"{inputs.case.id} {inputs.case.dtype}\n")
        if inputs.case.dtype == "bf16":
            raise RuntimeError("CUDA error: misaligned address")
        return super().run(inputs)


class OutOfMemoryOnce(TorchChunk):
    name = "planted_oom_once"
    description = "runs out of memory on its first call in each process (neighbours held the memory), then works"
    failed = False

    def run(self, inputs: KDAInputs) -> BackendOutput:
        if not OutOfMemoryOnce.failed:
            OutOfMemoryOnce.failed = True
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().run(inputs)


class OutOfMemoryAlways(TorchChunk):
    name = "planted_oom_always"
    description = "never fits: every call runs out of memory"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB")


class AsksForTheImpossible(TorchChunk):
    name = "planted_oom_past_the_device"
    description = "asks for 16 TiB, more than any device has: the kernel's error, not the machine's"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 TiB")


class SaysOutOfMemory(TorchChunk):
    name = "planted_says_out_of_memory"
    description = "raises its own RuntimeError whose text says 'out of memory': the kernel's error"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        raise RuntimeError("my_kernel: workspace out of memory (bad tile size)")


class FailsWhenTold(TorchChunk):
    name = "planted_fails_when_told"
    description = "the baseline, but its fp32 outputs are 10 % off while KDA_PLANTED_FAIL=1"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        if os.environ.get("KDA_PLANTED_FAIL") == "1" and inputs.case.dtype == "fp32":
            return BackendOutput(o=out.o * 1.1, final_state=out.final_state, checkpoint_states=out.checkpoint_states)
        return out


class Raises(TorchChunk):
    name = "planted_raises"
    description = "raises RuntimeError(KDA_PLANTED_MESSAGE) on every call, as a library refusing its inputs does"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        raise RuntimeError(os.environ.get("KDA_PLANTED_MESSAGE", "planted"))


PLANTED = (Segfault, Hang, StickyFault, CrashesOnBf16, OutOfMemoryOnce, OutOfMemoryAlways, FailsWhenTold, Raises)
for backend in (*PLANTED, AsksForTheImpossible, SaysOutOfMemory):
    register(backend.name, backend)
