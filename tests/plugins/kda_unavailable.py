"""A backend that is never available here (for the strict-mode tests)."""

from __future__ import annotations

import torch

from kda_kernels.protocol import Support
from kda_kernels.registry import register
from kda_kernels.torch_chunk import TorchChunk


class NeedsAnAccelerator(TorchChunk):
    name = "needs_an_accelerator"
    description = "stands for a backend whose package or device is missing"

    def availability(self, device: torch.device) -> Support:
        return Support.no("the accelerator this backend needs is not in this machine")


register(NeedsAnAccelerator.name, NeedsAnAccelerator)
