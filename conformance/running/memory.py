"""GPU memory shared by parallel workers: every case holds the device shared, a large case (and a retry
after running out of memory) holds it alone, through a file lock all the workers on one GPU take.

Eight pytest-xdist workers on one H200 each hold their own cases' truth and kernel memory; two 128K-token
cases at once can exhaust it while either fits alone. The lock is ``flock`` on a file named by the GPU's
UUID, so workers of different invocations on the same GPU share it too.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from kda_cases.case import Case

# Cases with more work than this (tokens x value heads x K x V) run alone on their GPU: 16K tokens x 16
# heads x 128^2. The float64 truth of a 128K x 16 x 128^2 case peaks at 47 GiB (docs/reference-speed.md),
# so two such cases beside six smaller ones do not fit one H200.
LARGE_WORK = 2**32


def work(case: Case) -> int:
    return case.total_tokens * case.num_v_heads * case.head_k_dim * case.head_v_dim


def _lock_path(device: torch.device) -> Path:
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return Path(tempfile.gettempdir()) / f"kda-conformance-gpu-{uuid}.lock"


@contextlib.contextmanager
def device_slot(device: torch.device, case: Case, alone: bool = False) -> Iterator[None]:
    """Hold ``device`` for ``case``: shared with other workers' cases, or alone for a large case or when
    ``alone``. A CPU needs no slot."""
    if device.type != "cuda":
        yield
        return
    exclusive = alone or work(case) > LARGE_WORK
    with open(_lock_path(device), "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def release_cached_memory(device: torch.device) -> None:
    """Give the allocator's cached blocks back, before a case is retried alone."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def visible_device(worker_index: int, gpus: list[str]) -> str:
    """The GPU a pytest-xdist worker takes: the workers spread round-robin over ``gpus``."""
    return gpus[worker_index % len(gpus)]


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES would name them."""
    for variable in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        listed = os.environ.get(variable)
        if listed:
            return [x.strip() for x in listed.split(",") if x.strip()]
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
