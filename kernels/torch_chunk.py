"""The same-precision pure-PyTorch baseline the tolerance policy measures kernels against.

It runs the kernels' chunked algebra (``kda_reference.chunked``) the way a plain
PyTorch port would: matmul operands and stored intermediates in the case's
input dtype, accumulation and the carried state in float32. Its error on a
case is what "working precision" costs there; a kernel's budget is a multiple
of it (docs/tolerance.md).
"""

from __future__ import annotations

import torch

from kda_cases.case import Case
from kda_cases.dtypes import TORCH_DTYPES, stored
from kda_cases.materialize import KDAInputs
from kda_kernels.protocol import Backend, BackendOutput, Support
from kda_reference.chunked import DEFAULT_CHUNK, kda_chunked


class TorchChunk(Backend):
    name = "torch_chunk"
    description = "pure-PyTorch chunked KDA in working precision (input-dtype operands, fp32 state): the baseline"
    produces_checkpoints = True

    def __init__(self, chunk_size: int = DEFAULT_CHUNK) -> None:
        self.chunk_size = self.chunk_tokens = chunk_size

    def availability(self, device: torch.device) -> Support:
        return Support.yes()

    def supports(self, case: Case) -> Support:
        return Support.yes()

    def run(self, inputs: KDAInputs) -> BackendOutput:
        case = inputs.case
        with torch.inference_mode():
            result = kda_chunked(
                inputs.q,
                inputs.k,
                inputs.v,
                inputs.g,
                inputs.beta,
                inputs.options,
                chunk_size=self.chunk_size,
                working_dtype=TORCH_DTYPES[case.dtype],
            )
        return BackendOutput(
            o=stored(case, "o", result.o),
            final_state=stored(case, "final_state", result.final_state),
            checkpoint_states=stored(case, "checkpoint_states", result.checkpoint_states),
        )
