"""Running cases through the budget check for the commands that sweep (run, nightly, calibrate): progress on
the terminal, each record journaled as it is measured, the run's files and the failures at the end."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kda_cases.case import Case
from kda_conformance.checks import CHECKS, Drawn
from kda_conformance.cli.common import say
from kda_conformance.judging.judge import judge_for
from kda_conformance.judging.repro import BUDGET_CHECK
from kda_conformance.running.config import DEFAULT_CASE_TIMEOUT
from kda_conformance.running.faults import DeviceLost
from kda_conformance.running.isolation import run_isolated
from kda_conformance.running.runner import fault_finding
from kda_conformance.running.session import Run
from kda_conformance.running.stages import CLOCK
from kda_kernels import guard, registry
from kda_kernels.guard import BackendFault
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


@dataclass(frozen=True)
class Call:
    """One case for one backend: the case as given, moved into the backend's envelope where asked to; or
    the backend's error where its ``fit`` raised on it."""

    case: Case
    backend: str
    fault: BackendFault | None = None


def planned_calls(cases: Sequence[Case], backends: Sequence[str], fit: bool = True) -> list[Call]:
    """Every case on every backend, case by case. With ``fit`` (every sweep but one of given ``--case``s,
    which reruns exactly what it names) each case is moved into each backend's envelope, so the narrowest
    backend runs the grid too, and a case that lands on one the backend already has is not run twice."""
    calls, seen = [], set()
    chosen = [registry.get(name) for name in backends]
    for case in cases:
        for backend in chosen:
            fault = None
            fitted = case
            if fit:
                try:
                    fitted = guard.fit(backend, case)
                except BackendFault as broken:
                    fault = broken
            if (fitted.id, backend.name) not in seen:
                seen.add((fitted.id, backend.name))
                calls.append(Call(fitted, backend.name, fault))
    return calls


def _findings(run: Run, calls: Sequence[Call]) -> Iterator[list[Finding]]:
    """The budget check of every call: in this process (each case's truth computed once, the run keeping it
    for the next backend), or each case in a worker process with ``--isolate``."""
    config, check = run.config, CHECKS[BUDGET_CHECK]
    faulted = {(c.case.id, c.backend): c.fault for c in calls if c.fault is not None}

    def fault_of(call: Call) -> list[Finding]:
        judge = judge_for(BUDGET_CHECK, call.case, call.backend, config.device)
        return [fault_finding(judge, faulted[(call.case.id, call.backend)])]

    if config.isolate:
        timeout = config.case_timeout or DEFAULT_CASE_TIMEOUT
        runnable = [(c.case, c.backend) for c in calls if c.fault is None]
        isolated = run_isolated(check, runnable, config.device, config.plugins, timeout)
        try:
            for call in calls:
                yield fault_of(call) if call.fault is not None else next(isolated)
        finally:
            isolated.close()  # the worker ends with the sweep
        return
    backends = {name: registry.get(name) for name in config.backends}
    for call in calls:
        yield fault_of(call) if call.fault is not None else run.checked(check, Drawn(call.case), backends[call.backend])


def sweep(run: Run, cases: Sequence[Case], console: Console, verbose: bool = False, fit: bool = True) -> SweepResult:
    """Every case through every backend of the run (moved into each backend's envelope with ``fit``); a Ctrl-C
    or a time limit's SIGTERM (raised as KeyboardInterrupt) stops it and keeps what was measured, the run
    marked incomplete."""
    CLOCK.drain()  # the run's timing file holds this run's time only
    failures: list[Finding] = []
    interrupted, stopped = False, ""
    calls = planned_calls(cases, run.config.backends, fit)
    total, done, started, said = len(calls), 0, time.monotonic(), time.monotonic()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("sweep", total=total)
        stream = _findings(run, calls)
        try:
            for findings in stream:
                rows = run.record(findings)
                if verbose:
                    lines = [record_line(row) for row in rows]
                    for line in [RECORD_LINE_HEADER, *lines] if done == 0 else lines:
                        progress.console.print(line, highlight=False, markup=False, soft_wrap=True)
                failures += [f for f in findings if f.failed]
                done += 1
                progress.update(task, advance=1, description=f"{findings[0].backend} {findings[0].case.label}")
                # Off a terminal (a CI log, | tee) the bar is not drawn: a line every so often instead.
                if not console.is_terminal and (time.monotonic() - said >= PROGRESS_EVERY_S or done == total):
                    said = time.monotonic()
                    console.print(
                        f"progress: {done} of {total} case x backend runs, {len(failures)} failures, "
                        f"{said - started:.0f} s",
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
