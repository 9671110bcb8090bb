"""``kda-conformance run``: the conformance sweep, a report, and the dashboard of every run under ``--out``."""

from __future__ import annotations

import argparse

from rich.console import Console

from kda_cases.case import Case
from kda_cases.corpus import load_corpus
from kda_cases.profiles import PROFILES
from kda_cases.strategies import draw_cases
from kda_conformance.cli.common import (
    add_backends,
    add_device,
    add_grid,
    add_isolation,
    add_out,
    add_reference_form,
    add_regressions,
    config_from_args,
    parse_case,
    typed,
)
from kda_conformance.cli.dashboard import rebuild_dashboard
from kda_conformance.cli.sweep import SweepResult, sweep
from kda_conformance.running.config import RunConfig
from kda_conformance.running.session import Run
from kda_conformance.running.stages import CLOCK
from kda_reports.console import record_table

NAME = "run"
HELP = "run the conformance sweep and write a report"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_out(parser)
    add_device(parser)
    add_backends(parser)
    add_grid(parser, default_dtypes=("bf16", "fp32"))
    parser.add_argument(
        "--profile",
        choices=list(PROFILES),
        default=None,
        help="instead of the first sweep: the committed corpus plus cases drawn for this profile",
    )
    parser.add_argument(
        "--examples", type=int, default=None, help="cases to draw for --profile (default: the profile's)"
    )
    parser.add_argument(
        "--dashboard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rebuild OUT/dashboard.html from every run under OUT afterwards (default: on)",
    )
    parser.add_argument(
        "--allow-empty",
        action="store_true",
        help="exit 0 when no case ran (every backend skipped every case); by default that is exit 5",
    )
    add_regressions(parser)
    add_isolation(parser)
    add_reference_form(parser)
    parser.add_argument(
        "--case",
        action="append",
        dest="cases",
        type=typed(parse_case),
        metavar="JSON_OR_FILE",
        help="run this case instead of the sweep: case JSON (seq_lens required, the other fields default as in "
        "cases/case.py), a .json file or a corpus id; repeatable; every failure prints such a command",
    )


def profile_cases(config: RunConfig, examples: int | None, console: Console) -> list[Case]:
    """The corpus cases the profile admits, then freshly drawn ones (the seed goes into the report)."""
    profile = config.profile
    assert profile is not None
    # One case list serves every backend here, so the interpreted backends' (tighter) corpus limit applies.
    pinned = [e.case for e in load_corpus() if profile.corpus_skip(e.case, interpreted=True) is None]
    for line in config.kernel_pool_lines():
        console.print(line, highlight=False)
    drawn = draw_cases(profile, examples or profile.max_examples, config.seed)
    how = "derandomized" if config.seed is None else f"seed {config.seed} (rerun with --seed {config.seed})"
    console.print(f"profile {profile.name}: {len(pinned)} corpus cases, {len(drawn)} drawn, {how}")
    return pinned + drawn


NOTHING_RAN = 5  # as pytest's "no tests ran"


def report(result: SweepResult, console: Console, allow_empty: bool = False) -> int:
    """The summary of a finished sweep on the terminal; the exit code (1 when a case failed or a backend
    raised, 5 when nothing ran, unless ``allow_empty``, 130 when the sweep was stopped)."""
    frame, paths = result.frame, result.paths
    if result.interrupted:
        console.print(f"partial records: {paths['records']}")
        return 130
    for line in record_table(frame.to_dict("records")):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    for row in frame[frame["verdict"] == "skip"].itertuples():
        console.print(f"[yellow]skip[/] {row.backend} {row.case_id} ({row.label}): {row.reason}")
    for message in result.failures:
        console.print(f"[red]FAIL[/] {message}", highlight=False, soft_wrap=True)
    if result.stopped:
        console.print(f"[red]stopped:[/] {result.stopped}", highlight=False, soft_wrap=True)
    counts = frame["verdict"].value_counts().to_dict()
    console.print(f"run {frame['run_id'].iloc[0]}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    console.print(f"records: {paths['records']}\nsummary: {paths['summary_md']}")
    console.print("suite time by stage: " + "\n  ".join(CLOCK.lines()), highlight=False)
    if counts.get("fail") or counts.get("error") or result.stopped:
        return 1
    if not set(counts) - {"skip", "resource"} and not allow_empty:
        reasons = frame["reason"].fillna("").value_counts()
        console.print(
            f"[red]nothing ran:[/] no case ran on any selected backend ({len(frame)} records, all skipped or out "
            f"of memory); the most common reason: {reasons.index[0]!r}. Pass --allow-empty to accept such a run.",
            highlight=False,
            soft_wrap=True,
        )
        return NOTHING_RAN
    return 0


def execute(args: argparse.Namespace, console: Console) -> int:
    config = config_from_args(args, console)
    if config is None:
        return 2
    config.export()  # isolated case processes inherit the reference form
    if args.cases:
        cases = list(args.cases)
    elif config.profile is not None:
        cases = profile_cases(config, args.examples, console)
    else:
        cases = config.grid.cases()
    code = report(sweep(Run(config), cases, console, args.verbose), console, args.allow_empty)
    if args.dashboard and code != 130:
        rebuild_dashboard(config.out, None, args.window, args.growth, console)
    return code
