"""Correct implementations that round in other places than the baseline: the suite's controls.

Each computes KDA exactly as the definition says, in working precision, with its rounding where a real kernel
puts it: the baseline's chunked algebra in chunks of 16, 32 and 128 tokens (FlashKDA's 16 and 32, AITER's
chunk_size argument), a token-serial float32 loop (FLA's fused recurrent kernel's arithmetic), the states
entering the chunks from a parallel scan of the chunks' maps (AITER's segmented FlashKDA), and TF32 matmul
operands declared as the design (FLA's and SGLang's chunk kernels on NVIDIA). None of them is wrong, so none
may go red: tests/test_correct_variants.py holds every check of the ``ci`` profile, with 25 examples per test,
and a CPU-sized nightly to that (docs/detection.md), and ``kda-conformance detection`` shows their worst ratio.
Where a check or a floor fails one of them, the check or the rule changes (docs/tolerance.md says why).
"""

from __future__ import annotations

import torch

from kda_cases.dtypes import stored
from kda_kernels.api import BackendOutput, KDAInputs, WorkingPrecision, register
from kda_kernels.torch_chunk import TorchChunk
from kda_reference.recurrent import kda_recurrent

# The controls, name -> what rounds differently from the baseline.
VARIANTS: dict[str, str] = {}


def control(name: str, description: str):
    def wrap(cls: type[TorchChunk]) -> type[TorchChunk]:
        cls.name, cls.description, cls.correct_control = name, description, True
        VARIANTS[name] = description
        register(name, cls)
        return cls

    return wrap


def chunked(size: int) -> type[TorchChunk]:
    class Chunked(TorchChunk):
        def __init__(self) -> None:
            super().__init__(chunk_size=size)

    return Chunked


for size in (16, 32, 128):
    control(f"correct_chunk{size}", f"the baseline's chunked algebra in {size}-token chunks")(chunked(size))


@control("correct_token_loop_fp32", "a token-serial float32 loop, as FLA's fused recurrent kernel computes")
class TokenLoopFp32(TorchChunk):
    chunk_tokens = 1

    def run(self, inputs: KDAInputs) -> BackendOutput:
        case = inputs.case
        with torch.inference_mode():
            result = kda_recurrent(
                inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, inputs.options, compute_dtype=torch.float32
            )
        return BackendOutput(
            o=stored(case, "o", result.o),
            final_state=stored(case, "final_state", result.final_state),
            checkpoint_states=stored(case, "checkpoint_states", result.checkpoint_states),
        )


@control("correct_parallel_scan", "the states entering the chunks from a parallel scan of the chunks' affine maps")
class ParallelScan(TorchChunk):
    def __init__(self) -> None:
        super().__init__(state_pass="scan")


@control("correct_tf32_dots", "the baseline with every matmul operand rounded to TF32, declared as its design")
class Tf32Dots(TorchChunk):
    working_precision = WorkingPrecision(dots="tf32", source="tests/plugins/kda_correct_variants.py (a test's design)")

    def __init__(self) -> None:
        super().__init__(tf32_dots="nearest")
