"""``kda-conformance backends``: every registered backend, what it takes (its envelope, as data), the
libraries it comes from, the working precision it declares, and whether it runs here and why not.
``--table FILE`` writes the envelopes as markdown (docs/envelopes.md is its output with no device column)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from kda_cases.envelope import Envelope, shown
from kda_cases.files import atomic_write_text
from kda_conformance.cli.common import add_device, config_from_args, say
from kda_conformance.cli.exits import PASSED, USAGE
from kda_kernels import guard, registry
from kda_kernels.guard import BackendFault
from kda_kernels.protocol import Backend

NAME = "backends"
HELP = "list the registered backends: envelope, libraries, declared precision, and whether each runs here"
EXAMPLE = "kda-conformance backends --device cpu"

# The envelope's fields as the table's columns, in the record's order.
FIELDS = tuple(Envelope.__dataclass_fields__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device(parser)
    parser.add_argument(
        "--plugin", action="append", default=[], metavar="MODULE", help="module that registers more backends"
    )
    parser.add_argument("--table", type=Path, default=None, help="write the envelopes as markdown to this file")


def _declared(backend: Backend) -> dict[str, str]:
    libraries = ", ".join(library.name for library in backend.libraries) or "-"
    precision = backend.working_precision
    return {
        "library": libraries,
        "precision": "-" if precision is None else f"{precision.label} ({precision.source})",
    }


def envelopes_markdown(names: list[str]) -> str:
    """The envelope of every backend named, one row each (``any``: every value of the axis)."""
    columns = ["backend", "library", *FIELDS, "declared precision"]
    lines = [
        "# Backend envelopes",
        "",
        "What each built-in backend takes, as it declares it (`Backend.envelope`, cases/envelope.py): `supports` "
        "and `fit` follow from it, and every generated case is drawn inside it. `any` admits every value of the "
        "axis. Produced by `kda-conformance backends --table docs/envelopes.md`; a test holds this page to the "
        "code. A vendored server's backend narrows its gates to what the loaded tree's entry points take.",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for name in names:
        backend = registry.get(name)
        cells = shown(backend.envelope)
        declared = _declared(backend)
        row = [f"`{name}`", declared["library"], *(cells[f] for f in FIELDS), declared["precision"]]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in row) + " |")
    return "\n".join(lines) + "\n"


def builtin_names() -> list[str]:
    return [name for name in registry.names() if not registry.plugin_of(name)]


def execute(args: argparse.Namespace, console: Console) -> int:
    args.backends = None
    config = config_from_args(args, console)
    if config is None:
        return USAGE
    if args.table is not None:
        atomic_write_text(args.table, envelopes_markdown(builtin_names()))
        console.print(f"envelopes: {args.table}", highlight=False)
    device = config.device
    for name in registry.names():
        backend = registry.get(name)
        try:
            available = guard.availability(backend, device)
            envelope = guard.envelope(backend)
        except BackendFault as fault:
            say(console, f"{name}: raised instead of answering: {fault.reason}", "error:", "red")
            continue
        here = "runs here" if available else f"not here: {available.reason}"
        declared = _declared(backend)
        console.print(f"{name} ({declared['library']}): {here}", highlight=False, markup=False, soft_wrap=True)
        narrowed = {field: value for field, value in shown(envelope).items() if value not in ("any", "-")}
        takes = "; ".join(f"{field} {value}" for field, value in narrowed.items()) or "every case"
        console.print(f"  takes: {takes}", highlight=False, markup=False, soft_wrap=True)
        if backend.working_precision is not None:
            console.print(f"  declared precision: {declared['precision']}", highlight=False, soft_wrap=True)
    return PASSED
