"""The same-precision pure-PyTorch baseline the tolerance policy measures kernels against.

It runs the kernels' chunked algebra (``kda_reference.chunked``) the way a plain
PyTorch port would: matmul operands and stored intermediates in the case's
input dtype, accumulation and the carried state in float32. Its error on a
case is what "working precision" costs there; a kernel's budget is a multiple
of it (docs/tolerance.md).
"""

from __future__ import annotations

import torch

from kda_cases.dtypes import GRADIENT_TENSORS, TORCH_DTYPES, stored, stored_dtype
from kda_cases.envelope import Envelope
from kda_cases.materialize import KDAInputs
from kda_kernels.protocol import Backend, BackendOutput, Support, Unsupported, WorkingPrecision
from kda_reference.chunked import DEFAULT_CHUNK, kda_chunked
from kda_reference.gradients import Gradients, kda_gradients


class TorchChunk(Backend):
    name = "torch_chunk"
    description = "pure-PyTorch chunked KDA in working precision (input-dtype operands, fp32 state): the baseline"
    produces_checkpoints = True
    envelope = Envelope(backward=True)

    def __init__(
        self,
        chunk_size: int = DEFAULT_CHUNK,
        carried_state_dtype: str | None = None,
        tf32_dots: str | None = None,
        state_pass: str = "serial",
    ) -> None:
        self.chunk_size = self.chunk_tokens = chunk_size
        # A declared working precision's baseline keeps its state in this dtype between chunks, and rounds its
        # matmuls' operands to TF32 where the design's dots are TF32 ("nearest" or "truncated").
        self.carried_state_dtype = carried_state_dtype
        self.tf32_dots = tf32_dots
        # How the state passes from chunk to chunk (reference/chunked.py STATE_PASSES): a correct variant's
        # choice, never the budgets' baseline's.
        self.state_pass = state_pass

    @classmethod
    def at_precision(cls, precision: WorkingPrecision) -> TorchChunk:
        """The baseline at a declared working precision: its state kept in ``precision.state_dtype`` between
        chunks of ``precision.chunk`` tokens, its matmul operands rounded to ``precision.dots``."""
        tf32 = {"ieee": None, "tf32": "nearest", "tf32-truncated": "truncated"}[precision.dots]
        return cls(chunk_size=precision.chunk, carried_state_dtype=precision.state_dtype, tf32_dots=tf32)

    def availability(self, device: torch.device) -> Support:
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
                carried_state_dtype=TORCH_DTYPES[self.carried_state_dtype] if self.carried_state_dtype else None,
                tf32_dots=self.tf32_dots,
                state_pass=self.state_pass,
            )
        return BackendOutput(
            o=stored(case, "o", result.o),
            final_state=stored(case, "final_state", result.final_state),
            checkpoint_states=stored(case, "checkpoint_states", result.checkpoint_states),
        )

    def run_backward(self, inputs: KDAInputs, d_o: torch.Tensor, d_final: torch.Tensor | None) -> Gradients:
        """The same algebra's gradients at working precision (reference/gradients.py), each returned in its
        input's dtype: the baseline the gradients' budgets scale."""
        if self.carried_state_dtype is not None:
            raise Unsupported("the baseline's backward keeps its state in float32: no carried state precision")
        case = inputs.case
        found = kda_gradients(
            inputs.q,
            inputs.k,
            inputs.v,
            inputs.g,
            inputs.beta,
            inputs.options,
            d_o,
            d_final,
            working_dtype=TORCH_DTYPES[case.dtype],
            chunk_size=self.chunk_size,
            tf32_dots=self.tf32_dots,
        )
        return Gradients(**{name: x.to(stored_dtype(case, GRADIENT_TENSORS[name])) for name, x in found.items()})
