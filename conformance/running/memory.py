"""GPU memory shared by parallel workers: a case holds the shares of its GPU's memory it is expected to
need, through file locks that all the workers on one GPU take, and gives the allocator's cache back after.

Eight pytest-xdist workers on one H200 each hold their own cases' truth and kernel memory; two 128K-token
cases at once can exhaust it while either fits alone. A lock that made every large case run alone
serialised the nightly on the H200 (35 of 460 tests in 400 s with eight workers: the other workers waited
on the large cases, Triton compiles included), so a case takes shares in proportion to its size instead,
and small cases keep running beside a large one. The locks are ``flock`` on files in a folder named by the
GPU's UUID, so workers of different invocations on the same GPU share them too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gc
import math
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import torch

from kda_cases.case import Case
from kda_conformance.running.stages import CLOCK

# A GPU's memory in this many shares; a retry after an out-of-memory takes them all (the GPU alone).
SHARES = 16
# Of a GPU's memory, what the shares divide: the rest is the workers' CUDA contexts and truth caches.
USABLE = 0.85
# Expected peak GiB of a case: a floor (contexts, compile, small tensors) and bytes per unit of work
# (tokens x value heads x K x V). Measured on the H200 at 128K x 16 x 128^2 = 2^35 (docs/reference-speed.md):
# the working-precision baseline peaks at 19.1 GiB with the inputs, the float64 truth (blockwise) at 6.2 GiB,
# FLA's chunk kernel at 7.0 GiB; a case holds the truth's outputs (2 GiB) while the baseline runs, about
# 21 GiB in all, 0.62 bytes per unit.
FLOOR_GIB = 1.0
BYTES_PER_WORK = 0.7
POLL_S = 0.05
# Outside the shares, each worker holds its CUDA context with its loaded kernels (about 1 GiB) and the truths
# it keeps for the next backends of a case (bounded by TRUTH_CACHE_GIB, conformance/running/run.py).
CONTEXT_GIB = 1.0
TRUTH_CACHE_GIB = 3.0
# How many workers the plan puts on one GPU at most, whatever its memory: compile and the host's share of each
# case are CPU work, and past this the workers mostly wait on each other's shares.
MOST_WORKERS_PER_GPU = 16
# Set by the night for its workers: how many share one GPU, so that each sizes the shares as the plan did.
WORKERS_VARIABLE = "KDA_WORKERS_PER_GPU"


def work(case: Case) -> int:
    return case.total_tokens * case.num_v_heads * case.head_k_dim * case.head_v_dim


def expected_gib(case: Case) -> float:
    return FLOOR_GIB + BYTES_PER_WORK * work(case) / 2**30


def device_gib(device: torch.device) -> float:
    """The memory of ``device``: the GPU's, or the machine's RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def too_large(case: Case, device: torch.device) -> str | None:
    """Why ``case`` cannot fit ``device`` at all (its expected peak beyond the device's memory), or None:
    refused before a run starts, with the estimate, rather than dying in the allocator minutes in."""
    need, have = expected_gib(case), device_gib(device)
    if need <= have:
        return None
    return (
        f"case {case.id} ({case.label}) needs about {need:.0f} GiB at its peak (truth, baseline and kernel; "
        f"conformance/running/memory.py), more than the {have:.0f} GiB of {device}"
    )


def shared_gib(device_gib: float, workers: int | None = None) -> float:
    """What the shares of a ``device_gib`` GPU divide: its usable memory less what ``workers`` workers hold
    outside the shares (contexts and truth caches; ``workers`` from the night's plan when not given)."""
    if workers is None:
        workers = int(os.environ.get(WORKERS_VARIABLE, "0") or 0)
    return max(USABLE * device_gib - workers * (CONTEXT_GIB + TRUTH_CACHE_GIB), device_gib / SHARES)


def shares_for(case: Case, device_gib: float, workers: int | None = None) -> int:
    """The shares of a ``device_gib`` GPU that ``case`` takes: at least one, at most all of them."""
    share = shared_gib(device_gib, workers) / SHARES
    return max(1, min(SHARES, math.ceil(expected_gib(case) / share)))


@dataclasses.dataclass(frozen=True)
class WorkerPlan:
    """How a night's workers share its GPUs' memory."""

    gpus: int
    device_gib: float
    workers_per_gpu: int
    largest: Case | None
    # The most processes per GPU its memory holds with the largest case (workers_per_gpu or more): the compile
    # stage's, whose warm-up cases are small and whose compiling is CPU work that holds no shares.
    fitting_per_gpu: int

    @property
    def workers(self) -> int:
        return self.gpus * self.workers_per_gpu

    @property
    def compile_processes(self) -> int:
        return self.gpus * self.fitting_per_gpu

    def line(self) -> str:
        shared = shared_gib(self.device_gib, self.workers_per_gpu)
        largest = ""
        if self.largest is not None:
            count = shares_for(self.largest, self.device_gib, self.workers_per_gpu)
            largest = (
                f"; the largest case ({self.largest.label}) about {expected_gib(self.largest):.1f} GiB = "
                f"{count} of {SHARES} shares"
            )
        return (
            f"memory plan: {self.workers_per_gpu} workers per GPU x {self.gpus} GPU(s) of {self.device_gib:.0f} GiB; "
            f"each worker {CONTEXT_GIB + TRUTH_CACHE_GIB:.0f} GiB outside the shares (context {CONTEXT_GIB:.0f}, "
            f"truth cache {TRUTH_CACHE_GIB:.0f}); {SHARES} shares of {shared / SHARES:.1f} GiB, up to "
            f"{at_once(self.device_gib, self.workers_per_gpu)} small cases at once{largest}"
        )


def plan_workers(device_gib: float, gpus: int, cases: list[Case]) -> WorkerPlan:
    """The workers per GPU that run the most cases at once: each worker's context and truth cache outside the
    shares, the shares still able to hold the night's largest case with every worker present (at most
    MOST_WORKERS_PER_GPU, at least one), and of those counts the one whose shares hold the most of the
    smallest cases side by side (the fewest workers of equals).

    A case holds its shares through its whole check, its backend's compiling included. More workers shrink
    the shares: on an H100 with no case over 1 GiB, 16 workers left shares of 0.3 GiB, so the smallest case
    took 4 and 4 cases ran at once while 12 workers waited (that wait was 38 % and 40 % of the suite's time
    by stage in a shard job cold and warm, the results journal, twentieth session); 12 workers leave shares
    of 1.2 GiB and run 12."""
    largest = max(cases, key=expected_gib, default=None)
    need = expected_gib(largest) if largest is not None else FLOOR_GIB
    fits = int((USABLE * device_gib - need) // (CONTEXT_GIB + TRUTH_CACHE_GIB))
    most = max(1, min(MOST_WORKERS_PER_GPU, fits))
    best = max(range(1, most + 1), key=lambda workers: (at_once(device_gib, workers), -workers))
    return WorkerPlan(max(1, gpus), device_gib, best, largest, most)


def at_once(device_gib: float, workers: int) -> int:
    """How many of the smallest cases (FLOOR_GIB each) ``workers`` workers on a ``device_gib`` GPU run side by
    side: as many as the shares hold, at most one a worker."""
    share = shared_gib(device_gib, workers) / SHARES
    return min(workers, SHARES // math.ceil(FLOOR_GIB / share))


def _lock_folder(device: torch.device) -> Path:
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return Path(tempfile.gettempdir()) / f"kda-conformance-gpu-{uuid}"


@contextlib.contextmanager
def memory_shares(folder: Path, count: int, poll_s: float = POLL_S) -> Iterator[None]:
    """Hold ``count`` of the ``SHARES`` lock files in ``folder`` (made when missing) until the block ends.

    One taker at a time gathers shares, holding ``folder/turnstile`` while it waits for enough to be free,
    so a large case is not starved by small ones overtaking it, and two takers never hold part of what each
    other needs (no deadlock)."""
    if not 1 <= count <= SHARES:
        raise ValueError(f"count must be 1 to {SHARES}, got {count}")
    folder.mkdir(parents=True, exist_ok=True)
    held: list[IO[str]] = []
    began = time.perf_counter()
    try:
        with open(folder / "turnstile", "a") as turnstile:
            fcntl.flock(turnstile.fileno(), fcntl.LOCK_EX)
            try:
                while len(held) < count:
                    held += _free_shares(folder, count - len(held), {Path(h.name).name for h in held})
                    if len(held) < count:
                        time.sleep(poll_s)
            finally:
                fcntl.flock(turnstile.fileno(), fcntl.LOCK_UN)
        CLOCK.add("wait", time.perf_counter() - began)  # where a night's workers stand still
        yield
    finally:
        for handle in held:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
            handle.close()


def _free_shares(folder: Path, wanted: int, taken: set[str]) -> list[IO[str]]:
    got: list[IO[str]] = []
    for index in range(SHARES):
        name = f"share-{index:02d}"
        if len(got) == wanted or name in taken:
            continue
        handle = open(folder / name, "a")  # held open as long as the share is held
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        got.append(handle)
    return got


@contextlib.contextmanager
def device_slot(device: torch.device, case: Case, alone: bool = False) -> Iterator[None]:
    """Hold ``device`` for ``case``: the shares of its memory the case is expected to need, or all of them
    when ``alone`` (a retry after an out-of-memory). The holder gives the allocator's cached blocks back
    before it leaves (``release_cached_memory``, inside its fault guard: on a context a kernel killed, the
    release raises the kernel's error), so that what this worker holds between cases is not memory the
    other workers' shares count on. A CPU needs no slot."""
    if device.type != "cuda":
        yield
        return
    count = SHARES if alone else shares_for(case, device_gib(device))
    with memory_shares(_lock_folder(device), count):
        yield


def release_cached_memory(device: torch.device) -> None:
    """Give the allocator's cached blocks back (after each case, and before a case is retried alone). On a
    CPU there is no allocator cache: only the young generations are collected (the cycles the case itself
    left, say an exception's frames holding its tensors): a full collection walks the whole long-lived heap
    (Hypothesis, torch) after every case, which was most of a CPU test run's time."""
    if device.type != "cuda":
        gc.collect(1)
        return
    gc.collect()
    torch.cuda.empty_cache()


def release_quietly(device: torch.device) -> None:
    """Give the allocator's cache back where that can still be done (not on a context a kernel killed)."""
    try:
        release_cached_memory(device)
    except Exception:
        pass


def visible_device(worker_index: int, gpus: list[str]) -> str:
    """The GPU a pytest-xdist worker takes: the workers spread round-robin over ``gpus``."""
    return gpus[worker_index % len(gpus)]


def chosen_gpus(listed: str | None) -> list[str]:
    """The GPUs a night's workers spread over: those ``listed`` (``--gpus 0,1``), else every visible one."""
    return [x.strip() for x in listed.split(",") if x.strip()] if listed else visible_gpus()


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES would name them."""
    for variable in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        listed = os.environ.get(variable)
        if listed:
            return [x.strip() for x in listed.split(",") if x.strip()]
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
