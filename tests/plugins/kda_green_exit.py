"""A backend that registers ``os._exit(0)`` to run at exit and returns a wrong output: a run that failed must
still exit non-zero (issue 51: "3 fail", exit 0)."""

from __future__ import annotations

import atexit
import os

from kda_cases.materialize import KDAInputs
from kda_kernels.protocol import BackendOutput
from kda_kernels.registry import register
from kda_kernels.torch_chunk import TorchChunk


class ExitsGreen(TorchChunk):
    name = "green_exit_wrong_output"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        atexit.register(os._exit, 0)
        out = super().run(inputs)
        return BackendOutput(o=out.o + 1, final_state=out.final_state)


register(ExitsGreen.name, ExitsGreen, replace=True)
