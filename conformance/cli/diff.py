"""``kda-conformance diff``: what changed between two runs, finding by finding.

Each side is a run file, a run folder, or a store: every run under it is read and their records pooled
(a pytest-xdist invocation writes one run per worker). Records are matched by what they judge (case,
backend, check, tensor, subject), never by the environment they ran in: per match, the verdict and the worst
error/limit before and after, the largest changes first, and a summary line. It exits 1 when the second run
has a failure or error the first did not (for CI), 0 otherwise. ``--env`` also lists the environment fields
that differ; ``--exact`` compares every column of every record instead (the question "did this rerun give
the same bits").
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
from pathlib import Path

import pandas as pd
from rich.console import Console

from kda_conformance.cli.common import say
from kda_reports.findings import FAILED, worst_first_rank, worst_ratios
from kda_reports.runfile import read_run
from kda_reports.store import load_store

# What differs between two runs of the same code on the same inputs by design.
IGNORED = ("seconds", "reference_seconds", "run_id", "env_run_id", "env_date", "env_suite_commit", "env_hostname")
KEY = ("case_id", "backend", "check", "tensor", "subject")
EXAMPLE = "kda-conformance diff out/runs/BEFORE.parquet out/runs/AFTER.parquet"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("before", type=Path, help="a run file, or a folder of runs (a store)")
    parser.add_argument("after", type=Path, help="a run file, or a folder of runs (a store)")
    parser.add_argument(
        "--show", type=int, default=20, metavar="N", help="how many changed findings to list (default: 20)"
    )
    parser.add_argument("--env", action="store_true", help="also list the environment fields that differ")
    parser.add_argument(
        "--exact", action="store_true",
        help="compare every column of every record instead (times, run ids and the suite's commit aside): "
        "exit 1 when anything differs",
    )  # fmt: skip
    parser.add_argument(
        "--ignore", action="append", default=[], metavar="COLUMN",
        help="with --exact: also ignore this column (repeatable)",
    )  # fmt: skip


def records(path: Path) -> pd.DataFrame:
    if path.is_file():
        return read_run(path)
    if not path.is_dir():
        raise ValueError(f"{path} is neither a run file nor a folder of runs")
    return load_store(path).records


def execute(args: argparse.Namespace, console: Console) -> int:
    if args.show < 0:
        say(console, f"--show must be 0 or more, got {args.show}", "error:", "red")
        return 2
    try:
        before, after = records(args.before), records(args.after)
    except (OSError, ValueError) as exc:
        say(console, f"{exc}", "error:", "red")
        return 2
    if args.exact:
        return _exact(before, after, set(IGNORED) | set(args.ignore), console)
    old, new = findings(before), findings(after)
    both = old.add_suffix("_before").join(new.add_suffix("_after"), how="outer")
    both["change"] = [_change(row) for row in both.itertuples()]
    both = both.sort_values("change", ascending=False, kind="stable")
    matched = both.dropna(subset=["verdict_before", "verdict_after"])
    moved = matched[matched["verdict_before"] != matched["verdict_after"]]
    new_failures = both[both["verdict_after"].isin(FAILED) & ~both["verdict_before"].isin(FAILED)]
    only_before = int(both["verdict_after"].isna().sum())
    only_after = int(both["verdict_after"].notna().sum() - len(matched))
    console.print(
        f"{len(matched)} findings in both runs, {len(moved)} changed verdict; {only_before} only before, "
        f"{only_after} only after; {len(new_failures)} new failures or errors",
        highlight=False,
        soft_wrap=True,
    )
    shown = both[both["change"] > 0].head(args.show)
    for key, row in shown.iterrows():
        console.print(_line(key, row), highlight=False, markup=False, soft_wrap=True)
    if len(both[both["change"] > 0]) > len(shown):
        console.print(f"  ... {len(both[both['change'] > 0]) - len(shown)} more (--show N)", highlight=False)
    if args.env:
        for line in _environment(before, after):
            console.print(line, highlight=False, markup=False, soft_wrap=True)
    return 1 if len(new_failures) else 0


def findings(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per finding (KEY): its worst verdict and worst error/limit over its records."""
    columns = [c for c in KEY if c in frame]
    # One match may hold several records (a check's variants of one tensor): its worst verdict stands.
    frame = frame.assign(worst=worst_ratios(frame), severity=worst_first_rank(frame["verdict"]))
    frame[columns] = frame[columns].fillna("").astype(str)
    grouped = frame.sort_values("severity").groupby(columns, sort=False)
    return pd.DataFrame({"verdict": grouped["verdict"].first(), "worst": grouped["worst"].max()})


def _change(row) -> float:
    """How much a finding moved: a verdict change, a finding on one side only, then the ratio's relative move."""
    before, after = row.verdict_before, row.verdict_after
    if not isinstance(before, str) or not isinstance(after, str):
        return 1e12 if after in FAILED else 1e9
    if before != after:
        return 1e15 if after in FAILED else 1e10
    old, new = row.worst_before, row.worst_after
    if math.isnan(old) and math.isnan(new):
        return 0.0
    if math.isnan(old) or math.isnan(new):
        return 1e6
    return abs(new - old) / max(abs(old), 1e-12)


def _line(key: tuple, row: pd.Series) -> str:
    case, backend, check, tensor, subject = key
    what = " ".join(part for part in (case, backend, check, tensor or "-", f"({subject})" if subject else "") if part)
    verdicts = f"{_said(row['verdict_before'])} -> {_said(row['verdict_after'])}"
    ratios = f"{_ratio(row['worst_before'])} -> {_ratio(row['worst_after'])} of the limit"
    return f"  {what}: {verdicts}, {ratios}"


def _said(verdict: object) -> str:
    return verdict if isinstance(verdict, str) else "(absent)"


def _ratio(value: float) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3g}"


def _environment(before: pd.DataFrame, after: pd.DataFrame) -> list[str]:
    lines = []
    for column in sorted(c for c in set(before.columns) | set(after.columns) if c.startswith("env_")):
        if column in IGNORED:
            continue
        old = sorted({str(v) for v in before.get(column, pd.Series(dtype=str)).dropna()})
        new = sorted({str(v) for v in after.get(column, pd.Series(dtype=str)).dropna()})
        if old != new:
            lines.append(f"environment {column}: {', '.join(old) or '-'} -> {', '.join(new) or '-'}")
    return lines or ["environment: the same (times, run ids and the suite's commit aside)"]


def _rows(frame: pd.DataFrame, columns: list[str]) -> Counter:
    return Counter(tuple(repr(value) for value in row) for row in frame[columns].itertuples(index=False))


def _exact(before: pd.DataFrame, after: pd.DataFrame, ignored: set[str], console: Console) -> int:
    """Every column of every record, as a multiset of rows, values exactly (floats by their full repr)."""
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
        for row in list(extra)[:10]:
            shown = dict(zip(columns, row, strict=True))
            console.print(
                f"  {shown['case_id']} {shown['backend']} {shown['tensor']} {shown['verdict']}", highlight=False
            )
    return 1
