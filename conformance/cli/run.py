"""``kda-conformance run``: the conformance sweep, a report, and the dashboard of every run under ``--out``."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from kda_cases.case import Case
from kda_cases.corpus import load_corpus
from kda_cases.strategies import draw_cases
from kda_conformance.cli.common import (
    add_backends,
    add_device,
    add_grid,
    add_isolation,
    add_out,
    add_reference_form,
    add_regressions,
    add_strict,
    config_from_args,
    parse_case,
    say,
    typed,
)
from kda_conformance.cli.dashboard import after_run
from kda_conformance.cli.exits import ERRORED, FAILED, INTERRUPTED, NOTHING_RAN, PASSED, USAGE, verdict_exit
from kda_conformance.cli.sweep import SweepResult, sweep
from kda_conformance.running.config import RunConfig, baseline_warning
from kda_conformance.running.memory import too_large
from kda_conformance.running.options import add_options
from kda_conformance.running.run import Run
from kda_conformance.running.stages import CLOCK
from kda_kernels import registry
from kda_reports.console import record_table, stale_lines
from kda_reports.findings import grouped_failures, stale_known_issues
from kda_reports.junit import write_junit
from kda_reports.precision import precision_lines

EXAMPLE = "kda-conformance run --device cpu --backend torch_chunk --lengths 37,130 --out out"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_out(parser)
    add_device(parser)
    add_backends(parser)
    add_grid(parser, default_dtypes=("bf16", "fp32"))
    add_options(
        parser,
        ["profile", "examples", "run-id"],
        notes={"profile": "instead of the first sweep: the committed corpus plus cases drawn for this profile"},
    )
    parser.add_argument(
        "--dashboard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rebuild OUT/dashboard.html from every run under OUT afterwards (default: on)",
    )
    parser.add_argument(
        "--junit-xml", type=Path, default=None, metavar="FILE",
        help="also write the run as JUnit XML (one test case per case, backend and check) for a CI's test report",
    )  # fmt: skip
    parser.add_argument(
        "--allow-empty",
        action="store_true",
        help="exit 0 when no case ran (every backend skipped every case); by default that is exit 5",
    )
    add_strict(parser)
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


def profile_cases(config: RunConfig, examples: int | None, console: Console, seed: int | None = None) -> list[Case]:
    """The corpus cases the profile admits, then freshly drawn ones (the seed goes into the report)."""
    profile = config.profile
    assert profile is not None
    # One case list serves every backend here, so the interpreted backends' (tighter) corpus limit applies.
    pinned = [e.case for e in load_corpus() if profile.corpus_skip(e.case, interpreted=True) is None]
    for line in config.kernel_pool_lines():
        console.print(line, highlight=False)
    # And the interpreted backends' gates: safe ones only, where the profile says so.
    interpreted = any(registry.get(name).interpreted(config.device) for name in config.backends)
    drawn = draw_cases(profile.for_backend(interpreted), examples or profile.max_examples, config.seed)
    if seed is not None and config.seed is None:
        say(
            console,
            f"profile {profile.name} is derandomized (the same cases every run): --seed {seed} is not used",
            "note:",
        )
    how = "derandomized" if config.seed is None else f"seed {config.seed} (rerun with --seed {config.seed})"
    console.print(f"profile {profile.name}: {len(pinned)} corpus cases, {len(drawn)} drawn, {how}")
    return pinned + drawn


def report(
    result: SweepResult, console: Console, allow_empty: bool = False, strict: bool = False, verbose: bool = False
) -> int:
    """The summary of a finished sweep on the terminal; the exit code (cli/exits.py: 1 when a check failed,
    3 when nothing failed but something raised, crashed or hung, 5 when nothing ran, unless ``allow_empty``,
    130 when the sweep was stopped; under ``strict`` a warning or a retired known issue fails)."""
    frame, paths = result.frame, result.paths
    if result.interrupted:
        console.print(f"partial records: {paths['records']}")
        return INTERRUPTED
    if not verbose:  # with -v every record was printed as it was measured
        for line in record_table(frame.to_dict("records")):
            console.print(line, highlight=False, markup=False, soft_wrap=True)
    for row in frame[frame["verdict"] == "skip"].itertuples():
        say(console, f"{row.backend} {row.case_id} ({row.label}): {row.reason}", "skip", "yellow")
    # One block per finding (backend, check, what went wrong), not one per failing tensor of every case.
    for label, text in grouped_failures(result.failures):
        say(console, text, label, "red")
    if result.stopped:
        say(console, f"{result.stopped}", "stopped:", "red")
    counts = frame["verdict"].value_counts().to_dict()
    console.print(f"run {frame['run_id'].iloc[0]}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    console.print(f"records: {paths['records']}\nsummary: {paths['summary_md']}")
    console.print("suite time by stage: " + "\n  ".join(CLOCK.lines()), highlight=False)
    for line in precision_lines(frame):
        say(console, line, "declared precision:")
    stale = stale_known_issues(frame)
    for line in stale_lines(stale, strict):
        say(console, line)
    code = verdict_exit(counts, strict)
    if code == PASSED and strict and not stale.empty:
        return FAILED
    if code == NOTHING_RAN and not allow_empty:
        reasons = frame["reason"].fillna("").value_counts()
        say(
            console,
            f"no case ran on any selected backend ({len(frame)} records, all skipped or out of memory); the most "
            f"common reason: {reasons.index[0]!r}. Pass --allow-empty to accept such a run.",
            "nothing ran:",
            "red",
        )
        return NOTHING_RAN
    return PASSED if code == NOTHING_RAN else code


def execute(args: argparse.Namespace, console: Console) -> int:
    config = config_from_args(args, console, writes=True)
    if config is None:
        return USAGE
    config.export()  # isolated case processes inherit the reference form
    replaced = baseline_warning()
    if replaced:
        say(console, replaced, "warning:", "yellow")
    if args.cases:
        cases = list(args.cases)
    elif config.profile is not None:
        cases = profile_cases(config, args.examples, console, args.seed)
    else:
        cases = config.grid.cases()
    oversized = [why for why in (too_large(case, config.device) for case in cases) if why]
    if oversized:  # before any work: a sweep must not die in the allocator minutes in
        for why in oversized:
            say(console, why, "error:", "red")
        return USAGE
    run = Run(config, hung_exit=ERRORED)  # a hung case (--case-timeout) ends the sweep: an error
    # A given --case runs exactly as given (a repro line); the grid and the profile's cases are moved into
    # each backend's envelope, so a narrow backend gets them too.
    result = sweep(run, cases, console, args.verbose, fit=not args.cases)
    code = report(result, console, args.allow_empty, config.strict, args.verbose)
    if args.junit_xml is not None and not result.frame.empty:
        console.print(f"JUnit XML: {write_junit(result.frame, args.junit_xml)}", highlight=False)
    if args.dashboard and code != INTERRUPTED:
        code = after_run(config.out, args.window, args.growth, console, code)
    return code
