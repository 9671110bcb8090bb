"""Backends that declare a working precision (kda_kernels.api WorkingPrecision) for the tests of declared
precisions (tests/test_precision.py): a kernel that keeps its state in bf16 between 16-token chunks by
design, the same kernel with a planted bug on top, a kernel that declares a bf16 state it does not have; a
kernel whose float32 matmuls take TF32 operands by design, undeclared, and with twice its own error added; a
kernel in 128-token chunks, and the same with twice its error."""

from __future__ import annotations

import torch

from kda_cases.dtypes import stored
from kda_kernels.api import BackendOutput, KDAInputs, WorkingPrecision, register
from kda_kernels.torch_chunk import TorchChunk
from kda_reference.chunked import kda_chunked

SOURCE = "tests/plugins/kda_declared.py (a test's design)"
BF16_STATE = WorkingPrecision(state_dtype="bf16", chunk=16, source=SOURCE)
TF32_DOTS = WorkingPrecision(dots="tf32", source=SOURCE)


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


class Tf32DotsByDesign(TorchChunk):
    name = "declared_tf32_dots"
    description = "chunked KDA with its matmul operands rounded to TF32, declared"
    working_precision = TF32_DOTS

    def __init__(self) -> None:
        super().__init__(tf32_dots="nearest")


class Tf32DotsUndeclared(Tf32DotsByDesign):
    name = "undeclared_tf32_dots"
    description = "the same kernel, its TF32 dots not declared"
    working_precision = None


def _error_tripled(out: BackendOutput, inputs: KDAInputs) -> BackendOutput:
    """``out`` with twice its own error against the float64 chunked form added."""
    x, case = inputs, inputs.case
    exact = kda_chunked(x.q, x.k, x.v, x.g, x.beta, x.options)  # float64

    def off(got: torch.Tensor, truth: torch.Tensor, tensor: str) -> torch.Tensor:
        return stored(case, tensor, (truth + 3 * (got.double() - truth)).float())

    return BackendOutput(o=off(out.o, exact.o, "o"), final_state=off(out.final_state, exact.final_state, "final_state"))


class Tf32DotsTripleError(Tf32DotsByDesign):
    name = "declared_tf32_dots_and_twice_its_error"
    description = "the declared TF32 kernel with twice its own error added on top (its error tripled)"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        return _error_tripled(super().run(inputs), inputs)


class Chunk128(TorchChunk):
    """Nothing declared: its chunk_tokens alone holds it to the baseline at 128-token chunks."""

    name = "chunks_of_128"
    description = "chunked KDA in 128-token chunks (AITER's chunk_size=128)"

    def __init__(self) -> None:
        super().__init__(chunk_size=128)


class Chunk128TripleError(Chunk128):
    name = "chunks_of_128_and_twice_its_error"
    description = "the 128-token chunk kernel with twice its own error added on top (its error tripled)"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        return _error_tripled(super().run(inputs), inputs)


for backend in (
    Bf16StateByDesign,
    Bf16StateUndeclared,
    Bf16StateAndABug,
    DeclaresWhatItDoesNotDo,
    Tf32DotsByDesign,
    Tf32DotsUndeclared,
    Tf32DotsTripleError,
    Chunk128,
    Chunk128TripleError,
):
    register(backend.name, backend)
