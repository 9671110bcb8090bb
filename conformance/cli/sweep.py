"""The sweep as the commands that sweep (run, nightly, calibrate) show it: progress on the terminal, each
record journaled as it is measured, the run's files and the failures at the end. Which calls it makes and
how is the engine's (running/sweep.py)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kda_cases.case import Case
from kda_conformance.checks import CHECKS
from kda_conformance.cli.common import say
from kda_conformance.judging.repro import BUDGET_CHECK
from kda_conformance.running.faults import DeviceLost
from kda_conformance.running.memory import work
from kda_conformance.running.run import Run
from kda_conformance.running.stages import CLOCK
from kda_conformance.running.sweep import ANNOUNCE_WORK, call_findings, planned_calls, probe_rate
from kda_reports.console import RECORD_LINE_HEADER, record_line
from kda_reports.findings import Finding

PROGRESS_EVERY_S = 30.0


@dataclass
class SweepResult:
    frame: pd.DataFrame
    paths: dict[str, Path]
    failures: list[Finding] = field(default_factory=list)  # every failed tensor and error
    interrupted: bool = False
    stopped: str = ""  # why the sweep stopped before its end (a sticky device error), if it did


def sweep(run: Run, cases: Sequence[Case], console: Console, verbose: bool = False, fit: bool = True) -> SweepResult:
    """Every case through every backend of the run (moved into each backend's envelope with ``fit``); a Ctrl-C
    or a time limit's SIGTERM (raised as KeyboardInterrupt) stops it and keeps what was measured, the run
    marked incomplete."""
    CLOCK.drain()  # the run's timing file holds this run's time only
    failures: list[Finding] = []
    interrupted, stopped = False, ""
    calls = planned_calls(cases, run.config.backends, fit)
    check = CHECKS[BUDGET_CHECK]
    total, done, started, said = len(calls), 0, time.monotonic(), time.monotonic()
    planned = [work(call.case) for call in calls]
    if sum(planned) > ANNOUNCE_WORK:
        largest = max(calls, key=lambda call: work(call.case)).case
        fixed, per_work = probe_rate(run, largest, check)
        seconds = sum(fixed + per_work * w for w in planned)
        console.print(
            f"planned: {total} case x backend runs, {sum(c.case.total_tokens for c in calls)} tokens in all, the "
            f"largest {largest.label}; about {_duration(seconds)} (two probes of its shape through the truth and "
            "the baseline, scaled by work)",
            highlight=False,
            soft_wrap=True,
        )
        started = said = time.monotonic()
    work_done = 0
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("sweep", total=total)
        stream = call_findings(run, calls, check)
        try:
            for findings in stream:
                rows = run.record(findings)
                if verbose:
                    lines = [record_line(row) for row in rows]
                    for line in [RECORD_LINE_HEADER, *lines] if done == 0 else lines:
                        progress.console.print(line, highlight=False, markup=False, soft_wrap=True)
                failures += [f for f in findings if f.failed]
                work_done += planned[done]
                done += 1
                left = _left(time.monotonic() - started, work_done, sum(planned) - work_done)
                progress.update(task, advance=1, description=f"{findings[0].backend} {findings[0].case.label}; {left}")
                # Off a terminal (a CI log, | tee) the bar is not drawn: a line every so often instead.
                if not console.is_terminal and (time.monotonic() - said >= PROGRESS_EVERY_S or done == total):
                    said = time.monotonic()
                    console.print(
                        f"progress: {done} of {total} case x backend runs, {_failed_words(failures)}"
                        f"{said - started:.0f} s; {left}",
                        highlight=False,
                    )
        except KeyboardInterrupt:
            say(console, f"after {len(run.rows)} records; writing them", "interrupted", "yellow")
            interrupted = True
        except DeviceLost as lost:
            # This process's device context is dead: record the case that killed it and stop, saying so.
            run.record(lost.findings)
            failures += [f for f in lost.findings if f.failed]
            stopped = f"{lost}\n  the rest of the sweep needs a fresh process: --isolate runs each case in one"
        finally:
            stream.close()  # an isolated worker ends with the sweep
    paths = run.finish(complete=not (interrupted or stopped), keep_empty=True)
    assert run.frame is not None
    return SweepResult(run.frame, paths, failures, interrupted, stopped)


def _failed_words(failures: Sequence[Finding]) -> str:
    """The failed records so far in the words of the run's last line (``2 fail, 3 error, ``): a backend that
    raises is an error in both, never "failures" in one and "error" in the other."""
    counts = Counter(f.verdict for f in failures)
    return "".join(f"{n} {verdict}, " for verdict, n in sorted(counts.items())) or "nothing failed, "


def _left(elapsed: float, done: int, left: int) -> str:
    """What is left of the sweep, by the work done so far."""
    if done <= 0:
        return "estimating"
    return f"about {_duration(elapsed * left / done)} left"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
