"""``kda-conformance backends``: every registered backend, what it takes (its envelope, as data), the
libraries it comes from, the working precision it declares, and whether it runs here and why not.
``--table FILE`` writes the envelopes as markdown (docs/envelopes.md is its output with no device column)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from kda_cases.envelope import Envelope, shown
from kda_cases.files import atomic_write_text
from kda_conformance.cli.common import add_device, config_from_args, say
from kda_conformance.cli.exits import PASSED, USAGE
from kda_kernels import guard, registry
from kda_kernels.guard import BackendFault
from kda_kernels.protocol import Backend, Support
from kda_reports.environment import library_version

EXAMPLE = "kda-conformance backends --device cpu"

# The envelope's fields as the table's columns, in the record's order.
FIELDS = tuple(f.name for f in dataclasses.fields(Envelope))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device(parser)
    parser.add_argument(
        "--plugin", action="append", default=[], metavar="MODULE", help="module that registers more backends"
    )
    parser.add_argument("--table", type=Path, default=None, help="write the envelopes as markdown to this file")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON list instead: each backend's name, description, "
        "libraries with versions, availability here and why, envelope and declared precision",
    )  # fmt: skip


def _declared(backend: Backend) -> dict[str, str]:
    libraries = ", ".join(library.name for library in backend.libraries) or "-"
    precision = backend.working_precision
    if precision is None:
        return {"library": libraries, "precision": "-"}
    where = f" on {', '.join(precision.platforms)}" if precision.platforms else ""
    versions = f", read in {', '.join(precision.versions)}" if precision.versions else ""
    return {"library": libraries, "precision": f"{precision.label}{where}{versions} ({precision.source})"}


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
    lines += [
        "",
        "## The fields",
        "",
        "What each field of `Envelope` (`from kda_kernels.api import Envelope`) admits; a field left at its default "
        "admits every value of its axis, and a case outside any field is refused with a reason that names it.",
        "",
        "| field | default | what it admits |",
        "|---|---|---|",
    ]
    for field in dataclasses.fields(Envelope):
        default = field.default
        spelled = ", ".join(map(str, default)) if isinstance(default, tuple) else str(default)
        lines.append(f"| `{field.name}` | {spelled or '(none)'} | {Envelope.MEANINGS[field.name]} |")
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
    listed: list[dict[str, Any]] = []
    for name in registry.names():
        backend = registry.get(name)
        try:
            available = guard.availability(backend, device)
            envelope = guard.envelope(backend)
        except BackendFault as fault:
            listed.append({"name": name, "runs_here": False, "error": f"raised instead of answering: {fault.reason}"})
            continue
        listed.append(_entry(backend, available, envelope))
    if args.json:  # the whole answer is the JSON on stdout: a backend that raised is an entry with its error
        print(json.dumps(listed, indent=1))
        return PASSED
    for entry in [e for e in listed if "error" in e]:
        say(console, f"{entry['name']}: {entry['error']}", "error:", "red")
    listed = [e for e in listed if "error" not in e]
    for entry in listed:
        libraries = "; ".join(f"{lib} {version}" for lib, version in entry["libraries"].items()) or "-"
        here = "runs here" if entry["runs_here"] else f"not here: {entry['why_not']}"
        console.print(f"{entry['name']} ({libraries}): {here}", highlight=False, markup=False, soft_wrap=True)
        console.print(f"  takes: {entry['takes']}", highlight=False, markup=False, soft_wrap=True)
        if entry["declared_precision"] != "-":
            console.print(f"  declared precision: {entry['declared_precision']}", highlight=False, soft_wrap=True)
    return PASSED


# Envelope fields that declare what a backend can do besides taking cases: never part of "takes".
CAPABILITIES = ("graph_capture", "backward")


def _entry(backend: Backend, available: Support, envelope: Envelope) -> dict[str, Any]:
    """One backend as data: what ``backends`` prints, and ``--json`` gives whole."""
    shown_envelope = shown(envelope)
    # What it takes: a capability it declares besides (a backward pass) narrows nothing.
    narrowed = {
        field: value
        for field, value in shown_envelope.items()
        if value not in ("any", "-") and field not in CAPABILITIES
    }
    return {
        "name": backend.name,
        "description": getattr(backend, "description", ""),
        "plugin": registry.plugin_of(backend.name),
        "libraries": {lib.name: library_version(lib.distribution, lib.source_variable) for lib in backend.libraries},
        "runs_here": bool(available),
        "why_not": "" if available else available.reason,
        "takes": "; ".join(f"{field} {value}" for field, value in narrowed.items()) or "every case",
        "envelope": shown_envelope,
        "declared_precision": _declared(backend)["precision"],
    }
