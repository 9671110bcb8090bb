"""Faults of real GPUs, told apart: a sticky device error (the context is dead: nothing more may run in
this process), running out of memory (the suite's neighbours' fault as often as the kernel's), or an
ordinary exception (the kernel's own)."""

from __future__ import annotations

import re

import torch

# What CUDA and HIP say when a kernel leaves the device context unusable: every later call in the process
# fails with the same error, whoever makes it.
STICKY = (
    "illegal memory access",
    "an illegal instruction",
    "misaligned address",
    "device-side assert",
    "unspecified launch failure",
    "launch timed out",
    "uncorrectable ecc",
    "cudaerrorillegaladdress",
    "cudaerrorlaunchfailure",
    "cudaerrorassert",
    "hiperrorillegaladdress",
    "hiperrorlaunchfailure",
    "hiperrorassert",
    "memory access fault",
)
OUT_OF_MEMORY = ("out of memory", "hiperroroutofmemory", "cudaerrormemoryallocation")
# Exit code of a pytest-xdist worker that ended itself after a sticky device error (xdist replaces it).
DEVICE_LOST_EXIT = 75


def is_sticky(text: str | BaseException) -> bool:
    """Whether an exception (or a finding's reason) is a sticky device error."""
    lowered = str(text).lower()
    return any(pattern in lowered for pattern in STICKY)


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or any(p in str(exc).lower() for p in OUT_OF_MEMORY)


def memory_report(exc: BaseException, device: torch.device) -> str:
    """What the allocation asked for and what the device had: the reason of a ``resource`` finding."""
    asked = re.search(r"tried to allocate ([\d.]+ [KMGT]i?B)", str(exc), re.IGNORECASE)
    parts = [f"needed {asked.group(1)} more" if asked else "an allocation failed"]
    if device.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(device)
        held = torch.cuda.max_memory_allocated(device)
        parts.append(f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free on the device")
        parts.append(f"this process peaked at {held / 2**30:.1f} GiB")
    return "out of memory: " + ", ".join(parts)


class DeviceLost(Exception):
    """A sticky device error ended what this process may run; ``findings`` charge it to the case and backend
    that launched it."""

    def __init__(self, findings: list, message: str) -> None:
        super().__init__(message)
        self.findings = findings
