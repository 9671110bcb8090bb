"""Backends that take their process down: a segfault and a hang (for the isolation tests; never in the zoo,
which runs in one process)."""

from __future__ import annotations

import os
import signal
import time

from kda_cases.materialize import KDAInputs
from kda_kernels.protocol import BackendOutput
from kda_kernels.registry import register
from kda_kernels.torch_chunk import TorchChunk


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


for backend in (Segfault, Hang):
    register(backend.name, backend)
