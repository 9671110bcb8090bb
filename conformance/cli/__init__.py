"""``kda-conformance``: the suite outside pytest, one module per command."""

from __future__ import annotations

import argparse
import errno
import importlib
import importlib.metadata
import shlex
import sys
from dataclasses import dataclass
from types import ModuleType

from rich.console import Console

from kda_conformance.cli.exits import INTERRUPTED, USAGE
from kda_conformance.running.interrupts import sigterm_interrupts
from kda_kernels.left_work import exit_past_left_work, flush_and_exit


@dataclass(frozen=True)
class Command:
    """A command: its name (and module, ``kda_conformance.cli.<name>``, holding ``add_arguments``, ``execute``
    and ``EXAMPLE``) and its one-line help. The module is imported only when the command is chosen, so
    ``--help``, ``--version`` and the commands that run no kernel start without torch."""

    name: str
    help: str

    @property
    def module(self) -> ModuleType:
        return importlib.import_module(f"kda_conformance.cli.{self.name}")


COMMANDS: tuple[Command, ...] = (
    Command("run", "run the conformance sweep and write a report"),
    Command("nightly", "the nightly job: the night's tests over parallel workers into a store, then the dashboard"),
    Command("dashboard", "build the HTML tolerance dashboard from a run store"),
    Command("corpus", "list or add pinned cases (cases/corpus)"),
    Command("repro", "rerun one check on one case, say where it goes wrong, and write a standalone test"),
    Command("minimize", "search a smaller case that fails the same check the same way, and print its repro line"),
    Command(
        "findings",
        "tabulate the findings ready for upstream (ledger entries and new failures) and write their standalone tests",
    ),
    Command(
        "triage",
        "rerun each untriaged finding's smallest case with one switch at a time and name the one that clears it",
    ),
    Command(
        "sanitize",
        "rerun each finding's smallest case under compute-sanitizer and record the kernel and access it names",
    ),
    Command("ledger", "print the ledger of known upstream problems, or write it as a page (docs/known-issues.md)"),
    Command(
        "detection",
        "run the properties and the corpus for some backends (say, planted bugs) and tabulate what caught each",
    ),
    Command("calibrate", "measure error/budget ratios over a grid of cases and write the calibration table"),
    Command("checks", "list the registered checks (docs/checks.md), or run each on one case per backend (--run)"),
    Command(
        "backends",
        "list the registered backends: envelope, libraries, declared precision, and whether each runs here",
    ),
    Command(
        "history",
        "each cell's status over the store's nights: streak, last green, flips, and what changed since green",
    ),
    Command(
        "diff",
        "what changed between two runs, by finding: verdicts and error/limit ratios (exit 1 on a new failure)",
    ),
    Command(
        "benchmark",
        "time the float64 reference forms beside FLA's float32 loop and the kernels, with peak memory",
    ),
    Command(
        "autotune",
        "merge the autotune choices a warm run recorded (KDA_AUTOTUNE_RECORD=DIR) into a GPU model's replay file",
    ),
    Command(
        "shards",
        "a measured night's seconds per backend as this GPU model's shard cost file, and the plan for N shards",
    ),
)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or (``only``, "" for none) one whose other commands are names and help lines only."""
    parser = argparse.ArgumentParser(
        prog="kda-conformance",
        description="How far is a KDA prefill kernel from the exact result? Sweeps, reports, dashboards, repros.",
    )
    parser.add_argument("--version", action=_VersionAction, help="show the package's version and the suite's commit")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        chosen = sub.add_parser(command.name, help=command.help, description=command.help)
        if only is None or command.name == only:
            command.module.add_arguments(chosen)
    return parser


class _VersionAction(argparse.Action):
    """``--version``: its text is found only when it is printed (it asks git for the suite's commit)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(version())  # on standard output, as argparse's own version action prints it
        parser.exit()


def version() -> str:
    """``kda-conformance 0.1.0 (commit abc123def456)``: the package's version and the suite's commit."""
    try:
        number = importlib.metadata.version("kda-conformance")
    except importlib.metadata.PackageNotFoundError:
        number = "(not installed)"
    from kda_reports.environment import suite_commit

    commit, source = suite_commit()
    return f"kda-conformance {number} (commit {commit}, from {source})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(only=_chosen(argv)).parse_args(argv)
    args.command_line = "kda-conformance " + " ".join(shlex.quote(a) for a in _without_output_paths(argv))
    # Long lines stay whole in a CI log, never cut at 80 columns; text is printed as it is, never read as
    # rich markup (a tag or a reason holding "[/]" would otherwise end the command).
    console = Console(soft_wrap=True, markup=False)
    try:
        with sigterm_interrupts():  # a time limit stops a sweep like Ctrl-C does: the records so far are kept
            return next(c for c in COMMANDS if c.name == args.command).module.execute(args, console)
    except KeyboardInterrupt:
        console.print("interrupted", highlight=False)
        return INTERRUPTED
    # A plugin's backend that breaks the registry's rules, met when first asked for.
    except _loaded("kda_kernels.registry", "PluginError") as exc:
        console.print(f"error: {exc}", highlight=False)
        return USAGE
    except OSError as exc:  # the suite's own files (a full disk, a read-only store): one line naming the path
        name = errno.errorcode.get(exc.errno or 0, "")
        where = f"{exc.filename}: " if exc.filename else ""
        said = f"{exc.strerror or exc}" + (f" ({name})" if name else "")
        console.print(f"error: {where}{said}; what was written before it is kept", highlight=False)
        return USAGE
    finally:
        runfile = sys.modules.get("kda_reports.runfile")
        if runfile is not None:  # a command that never loaded it claimed no run id
            runfile.release_claims()


def entry() -> None:
    """The ``kda-conformance`` command: ``main``'s code is the process's exit code, whatever a backend or a
    plugin registered to run at exit (``atexit.register(os._exit, 0)`` made a failed run exit 0), and the
    process ends when main returns, whatever threads or children a backend left running."""
    code = main()
    if code:
        flush_and_exit(code)
    exit_past_left_work(0)
    sys.exit(0)


def _chosen(argv: list[str]) -> str:
    """The command ``argv`` names (its first word: a command's options come after it), or "" for none."""
    names = {command.name for command in COMMANDS}
    return next((arg for arg in argv[:1] if arg in names), "")


class _NeverRaised(Exception):
    pass


def _loaded(module: str, name: str) -> type[BaseException]:
    """An exception class of ``module`` if a command loaded it (only then can it have been raised); the
    ``except`` clause asks when an exception passes, so the CLI never imports the module (and torch) for it."""
    return getattr(sys.modules[module], name) if module in sys.modules else _NeverRaised


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
