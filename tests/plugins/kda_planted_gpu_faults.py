"""A backend whose small Triton kernel writes out of bounds on a GPU: CUDA's sticky illegal-address error,
which surfaces at the next synchronize. For the H200 test of fault containment: it must cost its own cases
only, among correct backends that keep passing (docs/dashboard.md)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kda_cases.materialize import KDAInputs
from kda_kernels.protocol import BackendOutput, Support
from kda_kernels.registry import register
from kda_kernels.torch_chunk import TorchChunk

FAR = 1 << 40  # elements past the output: far outside any allocation


@triton.jit
def _write_far(pointer, offset):
    tl.store(pointer + offset, 1.0)


class OutOfBoundsWrite(TorchChunk):
    name = "planted_oob_write"
    description = "the baseline, then a Triton kernel that writes 2^40 elements past its output (illegal address)"

    def availability(self, device: torch.device) -> Support:
        return Support.yes() if device.type == "cuda" else Support.no("a Triton kernel on a GPU is the point")

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        _write_far[(1,)](out.o, FAR)  # no synchronize: the suite's guard must catch it and charge it here
        return out


register(OutOfBoundsWrite.name, OutOfBoundsWrite)
