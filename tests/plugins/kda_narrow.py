"""A correct backend as narrow as FlashKDA, declared as a plugin author would (kda_kernels.api), and the same
kernel with its output 1 % off: the envelope's tests (tests/test_envelopes.py) hold the suite to drawing
inside a narrow envelope instead of filtering the whole space."""

from __future__ import annotations

from kda_kernels.api import BackendOutput, Envelope, KDAInputs, register
from kda_kernels.torch_chunk import TorchChunk

# FlashKDA's envelope (MoonshotAI/FlashKDA csrc/flash_kda.cpp): bf16, K = V = 128, no GVA, the lower-bound
# gate with q/k normalisation and beta's sigmoid in the kernel, no checkpoints.
FLASHKDA_LIKE = Envelope(
    dtypes=("bf16",),
    head_dims=(128,),
    equal_head_dims=True,
    gva=False,
    gates=("lower_bound",),
    l2norm_in_kernel=(True,),
    beta_sigmoid_in_kernel=(True,),
    checkpoints=False,
)


class NarrowCorrect(TorchChunk):
    name = "narrow_correct"
    description = "the baseline behind FlashKDA's envelope: correct, and as narrow as FlashKDA"
    envelope = FLASHKDA_LIKE
    produces_checkpoints = False
    correct_control = True


class NarrowOnePercentOff(NarrowCorrect):
    name = "narrow_one_percent_off"
    description = "the narrow correct backend with its output scaled by 1.01"
    correct_control = False

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        return BackendOutput(o=out.o * 1.01, final_state=out.final_state)


register(NarrowCorrect.name, NarrowCorrect)
register(NarrowOnePercentOff.name, NarrowOnePercentOff)
