"""Faults of real GPUs, told apart: a sticky device error (the context is dead: nothing more may run in
this process), running out of memory (the suite's neighbours' fault as often as the kernel's), or an
ordinary exception (the kernel's own)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import signal
import threading
import time

import torch

from kda_kernels.guard import exception_text

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
# Every form running out of memory takes: torch's OutOfMemoryError, and the AcceleratorError or RuntimeError
# that CUDA, HIP or cuBLAS raise when a context, a handle or a workspace cannot be allocated.
OUT_OF_MEMORY = (
    "out of memory",
    "hiperroroutofmemory",
    "cudaerrormemoryallocation",
    "cublas_status_alloc_failed",
    "hipblas_status_alloc_failed",
    "can't allocate memory",  # torch's CPU allocator (DefaultCPUAllocator)
)
# Exit code of a pytest-xdist worker that ended itself after a sticky device error (xdist replaces it).
DEVICE_LOST_EXIT = 75


def is_sticky(text: str | BaseException) -> bool:
    """Whether an exception (or a finding's reason) is a sticky device error."""
    lowered = (text if isinstance(text, str) else exception_text(text)).lower()
    return any(pattern in lowered for pattern in STICKY)


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError | MemoryError):
        return True
    return any(p in exception_text(exc).lower() for p in OUT_OF_MEMORY)


def memory_report(exc: BaseException, device: torch.device) -> str:
    """What the allocation asked for and what the device had: the reason of a ``resource`` finding."""
    text = exception_text(exc)
    asked = re.search(r"tried to allocate ([\d.]+ [KMGT]i?B)", text, re.IGNORECASE)
    parts = [f"needed {asked.group(1)} more" if asked else f"an allocation failed ({type(exc).__name__}: {text})"]
    if device.type == "cuda" and torch.cuda.is_available():
        try:  # a device that cannot even make a context fails these queries the same way
            free, total = torch.cuda.mem_get_info(device)
            held = torch.cuda.max_memory_allocated(device)
        except Exception as again:
            parts.append(f"the device's memory could not be queried ({type(again).__name__})")
        else:
            parts.append(f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free on the device")
            parts.append(f"this process peaked at {held / 2**30:.1f} GiB")
    return "out of memory: " + ", ".join(parts)


class DeviceLost(Exception):
    """A sticky device error ended what this process may run; ``findings`` charge it to the case and backend
    that launched it."""

    def __init__(self, findings: list, message: str) -> None:
        super().__init__(message)
        self.findings = findings


PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Make this (worker) process end when ``parent_pid`` does, however the parent ends (SIGKILL included):
    an orphaned worker stuck in a hung kernel would hold its GPU for good. On Linux the kernel sends SIGKILL
    (prctl PR_SET_PDEATHSIG); elsewhere a thread watches for the parent to go."""
    if os.getppid() != parent_pid:  # the parent is already gone
        os._exit(1)
    libc_name = ctypes.util.find_library("c")
    if libc_name and os.uname().sysname == "Linux":
        libc = ctypes.CDLL(libc_name, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0:
            if os.getppid() != parent_pid:  # it ended between the check and the prctl
                os._exit(1)
            return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()
