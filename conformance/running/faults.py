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
# Every form running out of memory takes: torch's OutOfMemoryError, and the runtime's own words in the
# AcceleratorError or RuntimeError that CUDA, HIP or cuBLAS raise when a context, a handle or a workspace
# cannot be allocated. A backend's own text that merely says "out of memory" is its error, not the machine's:
# a kernel that never produced a result must not read as one the machine stopped.
OUT_OF_MEMORY = (
    "cuda out of memory",
    "cuda error: out of memory",
    "hip out of memory",
    "hip error: out of memory",
    "hiperroroutofmemory",
    "cudaerrormemoryallocation",
    "cublas_status_alloc_failed",
    "hipblas_status_alloc_failed",
    "can't allocate memory",  # torch's CPU allocator (DefaultCPUAllocator)
    # Triton's driver loading a compiled kernel onto a full GPU: FLA's fp32 32K backward on an H100 whose
    # memory two other processes held said this, and was recorded as the kernel's error.
    "triton error [cuda]: out of memory",
)
_ASKED = re.compile(r"(?:tried to allocate|allocate)\s+([\d.]+)\s*([KMGTP]i?B|bytes)", re.IGNORECASE)
_UNITS = {"bytes": 1, "kb": 2**10, "kib": 2**10, "mb": 2**20, "mib": 2**20, "gb": 2**30, "gib": 2**30}
_UNITS |= {"tb": 2**40, "tib": 2**40, "pb": 2**50, "pib": 2**50}
# Exit code of a pytest-xdist worker that ended itself after a sticky device error (xdist replaces it).
DEVICE_LOST_EXIT = 75


def is_sticky(text: str | BaseException) -> bool:
    """Whether an exception (or a finding's reason) is a sticky device error."""
    lowered = (text if isinstance(text, str) else exception_text(text)).lower()
    return any(pattern in lowered for pattern in STICKY)


def asked_bytes(text: str) -> float | None:
    """The size an allocation error says was asked for ("Tried to allocate 2.00 GiB"), None where it says none."""
    found = _ASKED.search(text)
    return float(found.group(1)) * _UNITS[found.group(2).lower()] if found else None


def device_memory(device: torch.device) -> int | None:
    """All the memory ``device`` has (a GPU's, or the host's for the CPU); None where it cannot be told."""
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, RuntimeError, AssertionError):
        return None


def is_out_of_memory(exc: BaseException, device: torch.device | None = None) -> bool:
    """Whether ``exc`` is the machine running out of memory (a ``resource`` outcome): torch's or Python's
    memory error, or the runtime's own words for it (OUT_OF_MEMORY), asking for no more than ``device`` has
    in all. An allocation larger than the whole device is the kernel's error (it asked for 16 TiB)."""
    text = exception_text(exc).lower()
    if not (isinstance(exc, torch.cuda.OutOfMemoryError | MemoryError) or any(p in text for p in OUT_OF_MEMORY)):
        return False
    asked, total = asked_bytes(text), None if device is None else device_memory(device)
    return asked is None or total is None or asked <= total


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
