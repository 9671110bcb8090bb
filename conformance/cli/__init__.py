"""``kda-conformance``: the suite outside pytest, one module per command."""

from __future__ import annotations

import argparse
import errno
import importlib.metadata
import shlex
import sys
from types import ModuleType

from rich.console import Console

from kda_conformance.cli import (
    autotune,
    backends,
    benchmark,
    calibrate,
    checks,
    corpus,
    dashboard,
    detection,
    diff,
    findings,
    ledger,
    minimize,
    nightly,
    repro,
    run,
    shards,
    triage,
)
from kda_conformance.cli.exits import INTERRUPTED, USAGE
from kda_conformance.running.config import release_claims
from kda_conformance.running.interrupts import sigterm_interrupts
from kda_kernels.guard import exit_past_left_work, flush_and_exit
from kda_kernels.registry import PluginError
from kda_reports.environment import suite_commit

COMMANDS: tuple[ModuleType, ...] = (
    run,
    nightly,
    dashboard,
    corpus,
    repro,
    minimize,
    findings,
    triage,
    ledger,
    detection,
    calibrate,
    checks,
    backends,
    diff,
    benchmark,
    autotune,
    shards,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kda-conformance",
        description="How far is a KDA prefill kernel from the exact result? Sweeps, reports, dashboards, repros.",
    )
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_arguments(sub.add_parser(command.NAME, help=command.HELP, description=command.HELP))
    return parser


def version() -> str:
    """``kda-conformance 0.1.0 (commit abc123def456)``: the package's version and the suite's commit."""
    try:
        number = importlib.metadata.version("kda-conformance")
    except importlib.metadata.PackageNotFoundError:
        number = "(not installed)"
    commit, source = suite_commit()
    return f"kda-conformance {number} (commit {commit}, from {source})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.command_line = "kda-conformance " + " ".join(shlex.quote(a) for a in _without_output_paths(argv))
    # Long lines stay whole in a CI log, never cut at 80 columns; text is printed as it is, never read as
    # rich markup (a tag or a reason holding "[/]" would otherwise end the command).
    console = Console(soft_wrap=True, markup=False)
    try:
        with sigterm_interrupts():  # a time limit stops a sweep like Ctrl-C does: the records so far are kept
            return {command.NAME: command for command in COMMANDS}[args.command].execute(args, console)
    except KeyboardInterrupt:
        console.print("interrupted", highlight=False)
        return INTERRUPTED
    except PluginError as exc:  # a plugin's backend that breaks the registry's rules, met when first asked for
        console.print(f"error: {exc}", highlight=False)
        return USAGE
    except OSError as exc:  # the suite's own files (a full disk, a read-only store): one line naming the path
        name = errno.errorcode.get(exc.errno or 0, "")
        where = f"{exc.filename}: " if exc.filename else ""
        said = f"{exc.strerror or exc}" + (f" ({name})" if name else "")
        console.print(f"error: {where}{said}; what was written before it is kept", highlight=False)
        return USAGE
    finally:
        release_claims()


def entry() -> None:
    """The ``kda-conformance`` command: ``main``'s code is the process's exit code, whatever a backend or a
    plugin registered to run at exit (``atexit.register(os._exit, 0)`` made a failed run exit 0), and the
    process ends when main returns, whatever threads or children a backend left running."""
    code = main()
    if code:
        flush_and_exit(code)
    exit_past_left_work(0)
    sys.exit(0)


def _without_output_paths(argv: list[str]) -> list[str]:
    # A table names the command that produced it; where it was written is not part of that.
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--table", "--out"):
            skip = True
        elif not arg.startswith(("--table=", "--out=")):
            out.append(arg)
    return out
