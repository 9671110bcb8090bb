"""``kda-conformance history``: each cell's (backend, check, GPU model) status over the store's nights: tonight,
the streak, the last green night, the flips, and for a red cell what changed since it was green
(reports/history.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from kda_conformance.cli.common import say
from kda_conformance.running.option_values import parse_count
from kda_conformance.running.options import typed
from kda_reports.history import cell_history, departures, expected_from, history_lines, read_expected
from kda_reports.store import Store, load_store

EXAMPLE = "kda-conformance history --store nightly-store --csv history.csv"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", type=Path, required=True, metavar="DIR", help="the store to read")
    parser.add_argument(
        "--window",
        type=typed(lambda text: parse_count("--window", text, lowest=2)),
        default=10,
        metavar="N",
        help="the nights over which flips are counted (default 10)",
    )
    parser.add_argument("--csv", type=Path, default=None, metavar="FILE", help="also write the table as CSV")
    parser.add_argument(
        "--expected",
        type=Path,
        default=None,
        metavar="FILE",
        help="a team's expected-status file (CSV: backend, check, device, expected red or green, reason): exit 1 "
        "and say which cells left their expected status tonight (a cell it does not list is expected green)",
    )
    parser.add_argument(
        "--update-expected",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the expected-status file tonight's statuses make, red cells with the ledger entry their "
        "records name",
    )


def execute(args: argparse.Namespace, console: Console) -> int:
    try:
        store = load_store(args.store)
        history = cell_history(store, window=args.window)
        expected = read_expected(args.expected) if args.expected is not None else None
    except (OSError, ValueError) as exc:
        say(console, str(exc), "error:", "red")
        return 2
    for line in history_lines(history):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if args.csv is not None:
        try:
            args.csv.parent.mkdir(parents=True, exist_ok=True)
            history.to_csv(args.csv, index=False)
        except OSError as exc:
            say(console, f"--csv {args.csv}: {exc}", "error:", "red")
            return 2
    console.print(f"{len(history)} cells, {int((history['tonight'] == 'red').sum())} red tonight", highlight=False)
    if args.update_expected is not None:
        try:
            expected_from(history, _ledger_reasons(store)).to_csv(args.update_expected, index=False)
        except OSError as exc:
            say(console, f"--update-expected {args.update_expected}: {exc}", "error:", "red")
            return 2
        console.print(f"expected statuses: {args.update_expected}", highlight=False)
    if expected is not None:
        left = departures(history, expected)
        for line in left:
            say(console, line, "left its expected status:", "red")
        return 1 if left else 0
    return 0


def _ledger_reasons(store: Store) -> dict[tuple[str, str], str]:
    """The ledger entry each (backend, check) of the newest judged run names, where one does."""
    if "known_issue" not in store.records or store.judged_runs.empty:
        return {}
    newest = store.records[store.records["run_id"] == store.judged_runs["run_id"].iloc[-1]]
    named = newest[newest["known_issue"].fillna("").astype(str) != ""]
    return {
        (str(b), str(c)): str(k) for (b, c), k in named.groupby(["backend", "check"])["known_issue"].first().items()
    }
