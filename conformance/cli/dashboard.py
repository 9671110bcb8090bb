"""``kda-conformance dashboard``: the HTML tolerance dashboard of a run store, and its regression flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
from rich.console import Console

from kda_conformance.cli.common import add_out, add_regressions, say
from kda_conformance.cli.exits import ERRORED, FAILED, PASSED, USAGE
from kda_reports.dashboard import build_dashboard
from kda_reports.store import StoreError, load_store

EXAMPLE = "kda-conformance dashboard --out /srv/kda-store --fail-on-flags"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_out(parser)
    parser.add_argument("--html", type=Path, default=None, help="where to write it (default: STORE/dashboard.html)")
    parser.add_argument(
        "--fail-on-flags",
        action="store_true",
        help="exit 1 when the last complete run has regression flags (other than fixed ones), for CI",
    )
    add_regressions(parser)


def rebuild_dashboard(store_dir: Path, html: Path | None, window: int, growth: float, console: Console) -> pd.DataFrame:
    """The dashboard of every run under ``store_dir``; the regressions it flags, printed and returned."""
    store = load_store(store_dir)
    for problem in store.problems:
        say(console, f"{problem}", "store:", "yellow")
    target = html or Path(store_dir) / "dashboard.html"
    path, regressions = build_dashboard(store, target, window, growth)
    for row in regressions.itertuples():
        say(
            console,
            f"{row.backend} {row.family} {row.tensor}: worst {row.tonight:.3g} (before {row.before:.3g}); {row.cause}"
            + (f"\n  repro: {row.repro}" if row.repro else ""),
            row.kind,
            "red",
        )
    console.print(f"{store.runs_sentence()}; {len(regressions)} flags; dashboard: {path}", highlight=False)
    return regressions


def after_run(store_dir: Path, window: int, growth: float, console: Console, code: int) -> int:
    """The dashboard rebuilt after a run, and the run's exit code: the run's own, but where the dashboard
    cannot be built (the suite's fault, said so) a passing run says ERRORED."""
    try:
        rebuild_dashboard(store_dir, None, window, growth, console)
    except Exception as exc:  # the run's records are written; the page is the suite's problem, named
        say(console, f"the dashboard was not rebuilt (the suite's error): {type(exc).__name__}: {exc}", "error:", "red")
        return ERRORED if code == PASSED else code
    return code


def execute(args: argparse.Namespace, console: Console) -> int:
    try:
        regressions = rebuild_dashboard(args.out, args.html, args.window, args.growth, console)
    except StoreError as exc:
        say(console, f"--store: {exc}", "error:", "red")
        return USAGE
    flagged = regressions[regressions["kind"] != "fixed"] if not regressions.empty else regressions
    return FAILED if args.fail_on_flags and not flagged.empty else PASSED
