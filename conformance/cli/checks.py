"""``kda-conformance checks``: the registered checks as a table (docs/checks.md is its output)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from kda_conformance.checks import CHECKS

NAME = "checks"
HELP = "list the registered checks (what docs/checks.md shows)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--table", type=Path, default=None, help="also write the markdown page to this file")


def checks_markdown() -> str:
    lines = [
        "# Checks",
        "",
        "Every check the suite runs, from the registry (`conformance/checks/`), in the order every table "
        "shows them. Produced by `kda-conformance checks --table docs/checks.md`; a test holds this page "
        "to the registry.",
        "",
        "| check | title | pytest test | parameters | what it checks |",
        "|---|---|---|---|---|",
    ]
    for check in CHECKS.values():
        params = ", ".join(f"`--{p.name}`" for p in check.params) or "-"
        test = f"`conformance/test_{check.suite}.py::{check.test_name}`"
        lines.append(f"| `{check.name}` | {check.title} | {test} | {params} | {check.summary} |")
    return "\n".join(lines) + "\n"


def execute(args: argparse.Namespace, console: Console) -> int:
    text = checks_markdown()
    console.print(text, markup=False, highlight=False, soft_wrap=True)
    if args.table is not None:
        args.table.write_text(text)
    return 0
