"""``kda-conformance dashboard``: the HTML tolerance dashboard of a run store, and its regression flags."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from kda_conformance.cli.common import add_regressions
from kda_reports.dashboard import build_dashboard
from kda_reports.runfile import DEFAULT_OUT
from kda_reports.store import StoreError, load_store

NAME = "dashboard"
HELP = "build the HTML tolerance dashboard from a run store"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", type=Path, default=DEFAULT_OUT, help="the store: a run folder (default: ./out)")
    parser.add_argument("--html", type=Path, default=None, help="where to write it (default: STORE/dashboard.html)")
    add_regressions(parser)


def rebuild_dashboard(store_dir: Path, html: Path | None, window: int, growth: float, console: Console) -> None:
    """The dashboard of every run under ``store_dir``, and the regressions it flags, printed."""
    store = load_store(store_dir)
    for problem in store.problems:
        console.print(f"[yellow]store:[/] {problem}", highlight=False)
    target = html or Path(store_dir) / "dashboard.html"
    path, regressions = build_dashboard(store, target, window, growth)
    for row in regressions.itertuples():
        console.print(
            f"[red]{row.kind}[/] {row.backend} {row.family} {row.tensor}: worst {row.tonight:.3g} "
            f"(before {row.before:.3g}); {row.cause}" + (f"\n  repro: {row.repro}" if row.repro else ""),
            highlight=False,
            soft_wrap=True,
        )
    console.print(f"{len(store.runs)} runs, {len(regressions)} flags; dashboard: {path}")


def execute(args: argparse.Namespace, console: Console) -> int:
    try:
        rebuild_dashboard(args.store, args.html, args.window, args.growth, console)
    except StoreError as exc:
        console.print(f"[red]error:[/] --store: {exc}", highlight=False)
        return 2
    return 0
