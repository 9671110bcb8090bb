"""The envelopes several adapters share, as records (cases/envelope.py): what chunk_kda-style kernels take
(FLA's, AITER's, the servers' copies of FLA's), and FlashKDA's narrow corner of it."""

from __future__ import annotations

from kda_cases.envelope import Envelope

MAX_HEAD_K_DIM = 256
# The range chunk_kda and AITER accept for lower_bound when the safe gate is computed in the kernel.
SAFE_LOWER_BOUND_RANGE = (-5.0, 0.0)

# FLA's chunk_kda and the kernels derived from it: head_k_dim up to 256, the in-kernel safe gate's range.
CHUNK_KDA = Envelope(max_head_k_dim=MAX_HEAD_K_DIM, in_kernel_lower_bound=SAFE_LOWER_BOUND_RANGE)

# FlashKDA's own checks (MoonshotAI/FlashKDA csrc/flash_kda.cpp): bf16, K = V = 128, no GVA, the lower-bound
# gate with q/k normalisation and beta's sigmoid in the kernel; it returns no intermediate states.
FLASH_KDA = Envelope(
    dtypes=("bf16",),
    head_dims=(128,),
    equal_head_dims=True,
    gva=False,
    gates=("lower_bound",),
    l2norm_in_kernel=(True,),
    beta_sigmoid_in_kernel=(True,),
    checkpoints=False,
    gate_dtypes=("same",),  # csrc/flash_kda.cpp: TORCH_CHECK(g.dtype() == kBFloat16), and beta the same
)
