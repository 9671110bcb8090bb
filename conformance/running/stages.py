"""Where the suite's own time goes: seconds per stage of every case, summed over a process.

A nightly sweep is only worth its hours if they are spent in the kernels under
test, not in drawing inputs or computing the truth; the totals go to each run's
``<run_id>.timing.json`` and to the end of the terminal summary.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kda_cases.devices import synchronize

# "wait": a case waiting for its share of the GPU's memory (conformance/running/memory.py), no work at all.
STAGES = ("materialize", "reference", "baseline", "backend", "compare", "wait")


@dataclass
class Lap:
    """One timed block's seconds (set when the block ends)."""

    seconds: float = 0.0


class StageClock:
    """Seconds and calls per stage; GPU work is synchronized so it counts in its own stage."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.calls = dict.fromkeys(STAGES, 0)
        self.forms: dict[str, float] = {}  # reference seconds per exact form (loop, chunked)
        self.peaks: dict[str, float] = {}  # reported by worker processes (isolated runs)
        # Wall seconds of each pytest test (setup, call and teardown), in the process that reports the run:
        # a night's shards are balanced by them (conformance/running/shards.py).
        self.tests: dict[str, float] = {}
        self.compile_wall_seconds: float | None = None  # a night's compile stage, before its tests

    @contextmanager
    def stage(self, name: str, device: torch.device, form: str | None = None) -> Iterator[Lap]:
        """Time the block as stage ``name`` (``form``: the exact form of a reference stage); the yielded
        lap holds the block's own seconds once it ends, raised or not."""
        if name not in self.seconds:
            raise ValueError(f"stage {name!r} is not one of {', '.join(STAGES)}")
        lap = Lap()
        synchronize(device)
        start = time.perf_counter()
        finished = False
        try:
            yield lap
            finished = True
        except BaseException as exc:
            note_stage(exc, name)
            raise
        finally:
            if finished:  # a block that raised keeps its own exception, not a GPU error surfacing here
                synchronize(device)
            lap.seconds = time.perf_counter() - start
            self.seconds[name] += lap.seconds
            self.calls[name] += 1
            if form is not None:
                self.add_form(form, lap.seconds)

    def add(self, name: str, seconds: float) -> None:
        """Count ``seconds`` spent outside any device work (a wait) as one call of stage ``name``."""
        self.seconds[name] += seconds
        self.calls[name] += 1

    def add_night_compile_stage(self) -> None:
        """The compile stage a night ran before its pytest session and handed it (:data:`COMPILE_VARIABLE`),
        if any: its seconds over the jobs as the ``compile`` stage, and its wall time, so the run's timing
        file holds them when first written."""
        text = os.environ.get(COMPILE_VARIABLE)
        if text:
            stage = json.loads(text)
            self.seconds["compile"] = float(stage["seconds"])
            self.calls["compile"] = int(stage["jobs"])
            self.compile_wall_seconds = float(stage["wall_seconds"])

    def add_test(self, nodeid: str, seconds: float) -> None:
        self.tests[nodeid] = self.tests.get(nodeid, 0.0) + seconds

    def add_form(self, form: str, seconds: float) -> None:
        self.forms[form] = self.forms.get(form, 0.0) + seconds

    def drain(self) -> dict:
        """Totals since the last drain, in :meth:`snapshot`'s form, then zero (an isolated case's process
        sends them with each result)."""
        taken = self.snapshot()
        self.seconds, self.calls, self.forms = dict.fromkeys(STAGES, 0.0), dict.fromkeys(STAGES, 0), {}
        self.tests, self.compile_wall_seconds = {}, None
        return taken

    def absorb(self, taken: dict) -> None:
        """Add another process's totals (:meth:`drain` or :meth:`snapshot`, as sent or as a run part's
        ``timing.json``); its peak memory counts where it exceeds this process's."""
        for name, seconds in taken["seconds"].items():
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds
            self.calls[name] = self.calls.get(name, 0) + taken["calls"][name]
        for form, seconds in taken["reference_seconds_by_form"].items():
            self.add_form(form, seconds)
        for key, value in taken["peak_memory"].items():
            self.peaks[key] = max(self.peaks.get(key, 0.0), value)
        tests = taken.get("tests", {})  # absent from older timing files
        for nodeid, seconds in tests.items() if isinstance(tests, dict) else ():
            if isinstance(seconds, int | float):
                self.add_test(str(nodeid), seconds)

    def snapshot(self) -> dict:
        """Totals so far, with the peak memory (GPU: torch's allocator; CPU: max resident set) of this
        process or of any worker it absorbed."""
        peak = _peak_memory()
        for key, value in self.peaks.items():
            peak[key] = max(peak.get(key, 0.0), value)
        wall = {} if self.compile_wall_seconds is None else {"compile_wall_seconds": self.compile_wall_seconds}
        return {
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "calls": dict(self.calls),
            "reference_seconds_by_form": {k: round(v, 3) for k, v in self.forms.items()},
            "peak_memory": {k: round(v, 2) for k, v in peak.items()},
            "tests": {k: round(v, 3) for k, v in self.tests.items()},
            **wall,
        }

    def lines(self) -> list[str]:
        """A few lines for a terminal: seconds per stage and their share, peak memory."""
        snap = self.snapshot()
        total = sum(snap["seconds"].values()) or 1.0
        parts = [f"{name} {s:.1f} s ({100 * s / total:.0f}%)" for name, s in snap["seconds"].items()]
        forms = ", ".join(f"{form} {s:.1f} s" for form, s in snap["reference_seconds_by_form"].items())
        memory = ", ".join(f"{k} {v:.2f}" for k, v in snap["peak_memory"].items())
        return ["; ".join(parts), f"reference by form: {forms or 'none'}; peak memory: {memory}"]


CLOCK = StageClock()
# How ``nightly`` hands its compile stage (seconds, jobs, wall seconds, as JSON) to the pytest session that
# writes the run's files, so the timing file is written once, whole.
COMPILE_VARIABLE = "KDA_NIGHT_COMPILE_STAGE"
STAGE_ATTRIBUTE = "kda_stage"  # where an exception carries the stage it was raised in


def note_stage(exc: BaseException, name: str) -> None:
    """Mark ``exc`` with the stage it was raised in (the innermost one), so whoever catches it can say where."""
    if stage_of(exc) is None:
        try:
            setattr(exc, STAGE_ATTRIBUTE, name)  # an exception cannot be weakly referenced: it carries it
        except AttributeError:
            pass


def stage_of(exc: BaseException) -> str | None:
    """The stage ``exc`` was raised in (None: outside every stage, in a check's own code)."""
    return getattr(exc, STAGE_ATTRIBUTE, None)


def _peak_memory() -> dict[str, float]:
    peak = {"cpu_max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["gpu_max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return peak
