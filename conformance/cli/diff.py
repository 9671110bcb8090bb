"""``kda-conformance diff``: are two runs' records the same, times and run ids aside?

Each side is a run file, a run folder, or a store: every run under it is read and their records pooled
(a pytest-xdist invocation writes one run per worker). Rows are compared as a multiset, every column but
the ignored ones, values exactly (floats by their full representation).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import pandas as pd
from rich.console import Console

from kda_conformance.cli.common import say
from kda_reports.runfile import read_run
from kda_reports.store import load_store

NAME = "diff"
HELP = "compare two runs' records, every column but times, run ids and the suite's commit"
# What differs between two runs of the same code on the same inputs by design.
IGNORED = ("seconds", "reference_seconds", "run_id", "env_run_id", "env_date", "env_suite_commit", "env_hostname")
SHOWN = 10
EXAMPLE = "kda-conformance diff out/runs/BEFORE.parquet out/runs/AFTER.parquet"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("before", type=Path, help="a run file, or a folder of runs (a store)")
    parser.add_argument("after", type=Path, help="a run file, or a folder of runs (a store)")
    parser.add_argument(
        "--ignore", action="append", default=[], metavar="COLUMN", help="also ignore this column (repeatable)"
    )


def records(path: Path) -> pd.DataFrame:
    if path.is_file():
        return read_run(path)
    if not path.is_dir():
        raise ValueError(f"{path} is neither a run file nor a folder of runs")
    return load_store(path).records


def _rows(frame: pd.DataFrame, columns: list[str]) -> Counter:
    return Counter(tuple(repr(value) for value in row) for row in frame[columns].itertuples(index=False))


def execute(args: argparse.Namespace, console: Console) -> int:
    try:
        before, after = records(args.before), records(args.after)
    except (OSError, ValueError) as exc:
        say(console, f"{exc}", "error:", "red")
        return 2
    ignored = set(IGNORED) | set(args.ignore)
    columns_before = {c for c in before.columns if c not in ignored}
    columns_after = {c for c in after.columns if c not in ignored}
    if columns_before != columns_after:
        console.print(f"columns only before: {sorted(columns_before - columns_after)}", highlight=False)
        console.print(f"columns only after: {sorted(columns_after - columns_before)}", highlight=False)
        return 1
    columns = sorted(columns_before)
    rows_before, rows_after = _rows(before, columns), _rows(after, columns)
    if rows_before == rows_after:
        console.print(
            f"identical: {len(before)} records, {len(columns)} columns compared "
            f"(ignored: {', '.join(sorted(ignored))})",
            highlight=False,
            soft_wrap=True,
        )
        return 0
    for label, extra in (("only before", rows_before - rows_after), ("only after", rows_after - rows_before)):
        console.print(f"{sum(extra.values())} records {label}", highlight=False)
        for row in list(extra)[:SHOWN]:
            shown = dict(zip(columns, row, strict=True))
            console.print(
                f"  {shown['case_id']} {shown['backend']} {shown['tensor']} {shown['verdict']}", highlight=False
            )
    return 1
