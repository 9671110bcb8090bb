"""Backends whose call leaves work running when it returns (issue 51, item 3), each correct in its output:
a thread that writes into its input ``q`` or changes torch's default dtype ``DELAY`` seconds later, one
that never ends, a child process holding the run's standard output, and a thread that ends at once (no
failure). tests/test_left_work.py runs them."""

from __future__ import annotations

import subprocess
import threading
import time

import torch

from kda_cases.materialize import KDAInputs
from kda_kernels.protocol import BackendOutput
from kda_kernels.registry import register
from kda_kernels.torch_chunk import TorchChunk

DELAY = 0.05  # seconds after the call returns; tests set it past the guard's grace


def _later(work) -> None:
    def run() -> None:
        time.sleep(DELAY)
        work()

    threading.Thread(target=run, name="left-later", daemon=True).start()


class WritesQLater(TorchChunk):
    name = "left_writes_q_later"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        _later(lambda: inputs.q.view(-1)[-1:].add_(1))
        return out


class SetsDtypeLater(TorchChunk):
    name = "left_sets_dtype_later"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        _later(lambda: torch.set_default_dtype(torch.float64))
        return out


class EndsAtOnce(TorchChunk):
    """A helper thread that is done before the call's grace is: part of the call, no failure."""

    name = "left_thread_that_ends"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        threading.Thread(target=lambda: time.sleep(0.01), name="quick").start()
        return out


_STARTED: dict[str, object] = {}


class ThreadForever(TorchChunk):
    """A non-daemon thread that never ends (started on the first call): the interpreter would join it
    forever at exit."""

    name = "left_thread_forever"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        if "thread" not in _STARTED:
            _STARTED["thread"] = threading.Thread(target=lambda: time.sleep(10**6), name="forever")
            _STARTED["thread"].start()
        return out


class ChildHoldingStdout(TorchChunk):
    """A child process that inherits the run's standard output and outlives it (started on the first call):
    a reader of the run's output would wait on it."""

    name = "left_child_holding_stdout"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        if "child" not in _STARTED:
            _STARTED["child"] = subprocess.Popen(["sleep", "600"])
        return out


for backend in (WritesQLater, SetsDtypeLater, EndsAtOnce, ThreadForever, ChildHoldingStdout):
    register(backend.name, backend, replace=True)
