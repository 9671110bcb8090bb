"""Running cases through the budget check for the commands that sweep (run, nightly, calibrate): progress on
the terminal, each record journaled as it is measured, the run's files and the failures at the end."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kda_cases.case import Case
from kda_conformance.running.isolation import run_cases_isolated
from kda_conformance.running.runner import run_cases
from kda_conformance.running.session import Run
from kda_conformance.running.stages import CLOCK
from kda_kernels import registry
from kda_reports.console import record_line
from kda_reports.findings import Finding


@dataclass
class SweepResult:
    frame: pd.DataFrame
    paths: dict[str, Path]
    failures: list[str] = field(default_factory=list)  # one message per failed tensor or error
    interrupted: bool = False


def _findings(run: Run, cases: Sequence[Case]) -> Iterator[list[Finding]]:
    config = run.config
    if config.isolate:
        return run_cases_isolated(cases, config.backends, config.device, config.plugins, config.case_timeout)
    return run_cases(cases, [registry.get(name) for name in config.backends], config.device)


def sweep(run: Run, cases: Sequence[Case], console: Console, verbose: bool = False) -> SweepResult:
    """Every case through every backend of the run; a Ctrl-C or a time limit's SIGTERM (raised as
    KeyboardInterrupt) stops it and keeps what was measured, the run marked incomplete."""
    CLOCK.drain()  # the run's timing file holds this run's time only
    failures: list[str] = []
    interrupted = False
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("sweep", total=len(cases) * len(run.config.backends))
        stream = _findings(run, cases)
        try:
            for findings in stream:
                rows = run.record(findings)
                if verbose:
                    for row in rows:
                        progress.console.print(record_line(row), highlight=False, soft_wrap=True)
                failures += [f.message() for f in findings if f.failed]
                progress.update(task, advance=1, description=f"{findings[0].backend} {findings[0].case.label}")
        except KeyboardInterrupt:
            console.print(f"[yellow]interrupted after {len(run.rows)} records; writing them[/]")
            interrupted = True
        finally:
            stream.close()  # an isolated worker ends with the sweep
    paths = run.finish(complete=not interrupted, keep_empty=True)
    assert run.frame is not None
    return SweepResult(run.frame, paths, failures, interrupted)


def summary_table(frame: pd.DataFrame) -> Table:
    table = Table(title="KDA conformance: max-abs error against the float64 reference")
    for col in ("case", "backend", "tensor", "verdict", "max-abs", "budget", "rel-RMS", "s"):
        table.add_column(col, justify="right" if col in ("max-abs", "budget", "rel-RMS", "s") else "left")
    colors = {"pass": "green", "fail": "red", "error": "red", "skip": "yellow"}

    def fmt(x: float) -> str:
        return "" if pd.isna(x) else f"{x:.2e}"

    for row in frame.itertuples():
        verdict = f"[{colors.get(row.verdict, 'white')}]{row.verdict}[/]"
        table.add_row(
            f"{row.case_id}\n{row.label}",
            row.backend,
            row.tensor or "-",
            verdict,
            fmt(getattr(row, "max_abs", float("nan"))),
            fmt(getattr(row, "budget", float("nan"))),
            fmt(getattr(row, "rel_rms", float("nan"))),
            f"{row.seconds:.2f}",
        )
    return table
