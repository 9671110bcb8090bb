"""The command-line reference (docs/cli.md), made from the parser itself: every command, its options, its
example, and the table of run options every front end shares. Regenerate with
``python -m kda_conformance.cli.reference docs/cli.md``; a test holds the page to the code."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kda_cases.files import atomic_write_text
from kda_conformance.cli import COMMANDS, build_parser
from kda_conformance.running.options import options_markdown


def _options(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| option | what it does |", "|---|---|"]
    for action in parser._actions:  # argparse keeps no public list of a parser's options
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue  # a suppressed option is the suite's own (a side-by-side process's), not the user's
        spelled = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"
        if action.metavar and action.option_strings:
            spelled += f" {action.metavar}"
        text = (action.help or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {spelled} | {text} |")
    return rows if len(rows) > 2 else ["No options of its own."]


def cli_markdown() -> str:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    lines = [
        "# The command line",
        "",
        "Every `kda-conformance` command, its options and an example; produced by `python -m "
        "kda_conformance.cli.reference docs/cli.md` from the parser itself. Each command's exit codes are in "
        "[exit-codes.md](exit-codes.md#per-command); `kda-conformance --version` names the package and the "
        "suite's commit.",
        "",
        "## Run options (one table for every front end)",
        "",
        "The options that decide what a run runs and where it goes, from `conformance/running/options.py`: the "
        "command line spells them `--NAME`, pytest `--kda-NAME`, and `nightly` and `detection` hand them to their "
        "pytest runs from the same table. A command may fill in its own default (its help says so).",
        "",
        options_markdown(),
    ]
    for command in COMMANDS:
        lines += [f"## `kda-conformance {command.name}`", "", f"{command.help}.", ""]
        lines += ["    " + command.module.EXAMPLE, "", *_options(commands[command.name]), ""]
        lines += _subcommands(f"kda-conformance {command.name}", commands[command.name])
    return "\n".join(lines)


def _subcommands(name: str, parser: argparse.ArgumentParser) -> list[str]:
    """A command's own subcommands (``corpus add``, ``corpus list``), each with its options."""
    lines: list[str] = []
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help for choice in action._choices_actions}
        for sub, subparser in action.choices.items():
            lines += [f"### `{name} {sub}`", "", f"{helps.get(sub) or subparser.description or ''}.".lstrip("."), ""]
            lines += [*_options(subparser), ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = cli_markdown()
    if argv:
        atomic_write_text(Path(argv[0]), text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
