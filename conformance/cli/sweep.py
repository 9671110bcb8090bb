"""Running cases through the budget check for the commands that sweep (run, nightly, calibrate): progress on
the terminal, each record journaled as it is measured, the run's files and the failures at the end."""

from __future__ import annotations

import time
from collections import Counter
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
from kda_conformance.running.config import RunConfig
from kda_conformance.running.faults import DeviceLost
from kda_conformance.running.isolation import run_isolated
from kda_conformance.running.memory import work
from kda_conformance.running.option_values import DEFAULT_CASE_TIMEOUT
from kda_conformance.running.runner import fault_finding
from kda_conformance.running.session import Run
from kda_conformance.running.stages import CLOCK
from kda_kernels import guard, registry
from kda_kernels.guard import BackendFault
from kda_reports.console import RECORD_LINE_HEADER, record_line
from kda_reports.findings import Finding

PROGRESS_EVERY_S = 30.0
# Past this much planned work (tokens x value heads x K x V, summed over the calls) a sweep says how long it
# expects to take before it starts: a run of --lengths 1000000 worked for 3 minutes on a CPU without a word.
ANNOUNCE_WORK = 2**30
# The two probes' work (about 2K and 16K tokens at 2 heads of 64 x 64): below 2K a call's fixed cost hides
# the rate, and the rate per token on a CPU still grows up to about 32K (0.08 ms a token at 4K, 0.2 at 32K).
PROBE_WORK = (2**24, 2**27)


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
        isolated = run_isolated(check, runnable, config.device, config.plugins, timeout, config.redraws)
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
    planned = [work(call.case) for call in calls]
    if sum(planned) > ANNOUNCE_WORK:
        largest = max(calls, key=lambda call: work(call.case)).case
        fixed, per_work = _probe(run, largest)
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
        stream = _findings(run, calls)
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


def _probe_case(case: Case, work_units: int) -> Case:
    """A case of ``case``'s shape (heads, head sizes, dtype) of about ``work_units`` of work."""
    tokens = max(64, work_units // (case.num_v_heads * case.head_k_dim * case.head_v_dim))
    return Case(
        seq_lens=(tokens,), num_heads=case.num_heads, num_v_heads=case.num_v_heads,
        head_k_dim=case.head_k_dim, head_v_dim=case.head_v_dim, dtype=case.dtype,
    )  # fmt: skip


def _probe(run: Run, case: Case) -> tuple[float, float]:
    """Seconds per call and per unit of work, from the budget check of two short cases of ``case``'s shape on
    the baseline (the float64 truth, the baseline and one call): a line through the two, so that a call's
    fixed cost is not scaled by work (one probe alone overestimated a 1M-token sweep 2.5 times)."""
    from kda_kernels.torch_chunk import TorchChunk

    run = Run(RunConfig(device=run.config.device, backends=()), journal=False)  # the run's records stay its own
    timed = []
    for units in PROBE_WORK:
        probe = _probe_case(case, units)
        began = time.monotonic()
        run.checked(CHECKS[BUDGET_CHECK], Drawn(probe), TorchChunk())
        timed.append((work(probe), time.monotonic() - began))
    (w0, t0), (w1, t1) = timed
    if w1 <= w0:  # both at the smallest probe: no line, the rate of the one
        return 0.0, t1 / w1
    per_work = max(t1 - t0, 0.0) / (w1 - w0)
    return max(t0 - per_work * w0, 0.0), per_work


def _left(elapsed: float, done: int, left: int) -> str:
    """What is left of the sweep, by the work done so far."""
    if done <= 0:
        return "estimating"
    return f"about {_duration(elapsed * left / done)} left"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
