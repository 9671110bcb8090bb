"""Reference pages made from the code, which tests hold to it: the command line (docs/cli.md, from the parser
itself: every command, its options, its example, and the table of run options every front end shares) and
the module map (docs/modules.md: every module of the five packages with the first sentence of its docstring,
so no module is missing from the docs). Regenerate with
``python -m kda_conformance.cli.reference docs/cli.md docs/modules.md``."""

from __future__ import annotations

import argparse
import ast
import sys
import tomllib
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


REPO = Path(__file__).resolve().parents[2]


def _first_sentence(docstring: str | None, most: int = 200) -> str:
    """A docstring's first sentence (its title, a colon and what follows), on one line, cut at a word past
    ``most`` characters."""
    paragraph = " ".join((docstring or "").strip().split("\n\n", 1)[0].split())
    sentence = paragraph.split(". ", 1)[0].rstrip(".") + "."
    if len(sentence) > most:
        sentence = sentence[:most].rsplit(" ", 1)[0].rstrip(",;:") + " ..."
    return sentence.replace("|", "\\|") if paragraph else "(no docstring)"


def modules_markdown(repo: Path = REPO) -> str:
    """docs/modules.md: each package's modules (read, not imported) with what each holds."""
    folders: dict[str, str] = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    lines = [
        "# Every module",
        "",
        "Each module of the five packages (installed as `kda_*`, in the folders of the design card), with the first "
        "sentence of its docstring; produced by `python -m kda_conformance.cli.reference docs/modules.md` from the "
        "tree, and held to it by a test, so a new module appears here. How the layers fit: "
        "[architecture.md](architecture.md).",
    ]
    for name, folder in folders.items():
        root = repo / folder
        package = ast.get_docstring(ast.parse((root / "__init__.py").read_text()))
        lines += ["", f"## `{folder}/` ({name})", "", _first_sentence(package), ""]
        lines += ["| module | what it holds |", "|---|---|"]
        for path in sorted(root.rglob("*.py")):
            relative = path.relative_to(root)
            if path.name in ("__init__.py", "__main__.py") and relative.parent == Path("."):
                continue
            docstring = ast.get_docstring(ast.parse(path.read_text()))
            lines.append(f"| `{folder}/{relative.as_posix()}` | {_first_sentence(docstring)} |")
    return "\n".join(lines) + "\n"


PAGES = {"cli.md": cli_markdown, "modules.md": modules_markdown}


def main(argv: list[str] | None = None) -> int:
    """Write each page named (docs/cli.md, docs/modules.md); with none named, print the command line's."""
    argv = sys.argv[1:] if argv is None else argv
    unknown = [arg for arg in argv if Path(arg).name not in PAGES]
    if unknown:
        print(f"{', '.join(unknown)}: not a generated page; choose from {', '.join(PAGES)}", file=sys.stderr)
        return 2
    for arg in argv:
        atomic_write_text(Path(arg), PAGES[Path(arg).name]())
    if not argv:
        print(cli_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
