"""Backends that declare a working precision (kda_kernels.api WorkingPrecision) for the tests of declared
precisions (tests/test_precision.py): a kernel that keeps its state in bf16 between 16-token chunks by
design, the same kernel with a planted bug on top, and a kernel that declares a bf16 state it does not have."""

from __future__ import annotations

from kda_kernels.api import BackendOutput, KDAInputs, WorkingPrecision, register
from kda_kernels.torch_chunk import TorchChunk

BF16_STATE = WorkingPrecision(state_dtype="bf16", chunk=16, source="tests/plugins/kda_declared.py (a test's design)")


class Bf16StateByDesign(TorchChunk):
    name = "declared_bf16_state"
    description = "chunked KDA with its state kept in bf16 between 16-token chunks, declared"
    working_precision = BF16_STATE

    def __init__(self) -> None:
        super().__init__(chunk_size=16, carried_state_dtype="bf16")


class Bf16StateUndeclared(Bf16StateByDesign):
    name = "undeclared_bf16_state"
    description = "the same kernel, its bf16 state not declared"
    working_precision = None


class Bf16StateAndABug(Bf16StateByDesign):
    name = "declared_bf16_state_and_a_bug"
    description = "the declared bf16-state kernel with its output 1 % off"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        return BackendOutput(o=out.o * 1.01, final_state=out.final_state)


class DeclaresWhatItDoesNotDo(TorchChunk):
    name = "declared_needlessly"
    description = "the fp32-state baseline, declaring a bf16 state it does not keep"
    working_precision = BF16_STATE


for backend in (Bf16StateByDesign, Bf16StateUndeclared, Bf16StateAndABug, DeclaresWhatItDoesNotDo):
    register(backend.name, backend)
