"""What several commands share: option groups, the case argument, and turning options into a RunConfig."""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

from kda_cases.case import Case
from kda_cases.corpus import load_corpus
from kda_cases.grids import FIRST_SWEEP_LENGTHS
from kda_conformance.running.option_values import (
    DEFAULT_CASE_TIMEOUT,
    ConfigError,
    parse_choices,
    parse_count,
    parse_positive,
)
from kda_conformance.running.options import MISSING, add_options, config_keywords, typed
from kda_reports.findings import recorded_text

if TYPE_CHECKING:
    from kda_conformance.checks import Check, Param
    from kda_conformance.running.config import RunConfig

CLI_DEFAULT_BACKENDS = ("fla_chunk", "fla_recurrent")


def choices(what: str, allowed: tuple[str, ...]) -> Callable[[str], object]:
    return typed(lambda text: parse_choices(what, text, allowed))


def _is_file(text: str) -> bool:
    """Whether ``text`` names a file; a text no file system takes as a name (too long, a NUL) names none."""
    try:
        return Path(text).is_file()
    except (OSError, ValueError):
        return False


def parse_case(text: str) -> Case:
    """A case from JSON text, a .json file holding it, or the id of a pinned corpus case."""
    stripped = text.strip()
    if stripped.startswith("kda-") and "{" not in stripped and not _is_file(stripped):
        for entry in load_corpus():
            if entry.case.id == stripped:
                return entry.case
        raise ValueError(
            f"case id {stripped} is not in the corpus; pass the case JSON instead (every failure prints it)"
        )
    source = stripped
    if not stripped.startswith("{"):
        if not _is_file(stripped):
            raise ValueError(f"--case takes case JSON, a .json file or a corpus id; {text!r:.80} is none of them")
        source = Path(stripped).read_text()
    try:
        data = json.loads(source)
        if isinstance(data, dict) and isinstance(data.get("case"), dict) and "why" in data:
            data = data["case"]  # a corpus entry (cases/corpus/*.json): the case it pins
        return Case.from_dict(data) if isinstance(data, dict) else Case.from_json(source)
    except RecursionError:
        raise ValueError("--case: not a valid case: its JSON is nested too deep") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"--case: not a valid case: {exc}") from None


def say(console: Console, text: str, label: str = "", style: str = "") -> None:
    """One line on the console, printed as it is: text from kernels, cases and users (a tag, a reason, a
    case's JSON) is never read as rich markup; ``label`` goes before it in ``style``."""
    text = recorded_text(text, cut=False)  # credentials redacted, escape sequences escaped: a terminal is no record
    line = Text(f"{label} ", style=style) + Text(text) if label else Text(text)
    console.print(line, highlight=False, soft_wrap=True)


def add_device(parser: argparse.ArgumentParser, default: str = "auto") -> None:
    add_options(parser, ["device"], device=default)


def add_backends(parser: argparse.ArgumentParser, default: str = "fla_chunk and fla_recurrent") -> None:
    """``--plugin`` and ``--backend`` (``default``: which backends run when none is named, in words)."""
    add_options(parser, ["plugin", "backend"], notes={"backend": f"default: {default}"})


def add_check_params(parser: argparse.ArgumentParser) -> None:
    """Every parameter a registered check draws as an option (``--at 17``), so every repro line can be
    rerun (``repro``, ``minimize``)."""
    for param in check_params().values():
        parser.add_argument(
            f"--{param.name}", type=typed(param.parse), choices=param.choices, default=None, help=param.help
        )


def check_params() -> dict[str, Param]:
    """The parameters the registered checks draw, by name."""
    from kda_conformance.checks import CHECKS  # here: the checks bring torch, which most commands do without

    return {p.name: p for check in CHECKS.values() for p in check.params}


def missing_params(check: Check, params: dict[str, object], console: Console) -> bool:
    """Say which of ``check``'s parameters were not given; True when any is missing."""
    missing = [name for name, value in params.items() if value is None]
    if missing:
        say(console, f"check {check.name} needs " + ", ".join(f"--{name}" for name in missing), "error:", "red")
    return bool(missing)


def add_out(parser: argparse.ArgumentParser, required: bool = False) -> None:
    add_options(parser, ["out"], required={"out"} if required else set())


def add_grid(parser: argparse.ArgumentParser, default_dtypes: tuple[str, ...]) -> None:
    add_options(
        parser,
        ["lengths", "dtypes", "heads", "head-dim", "seed"],
        dtypes=default_dtypes,
        notes={"lengths": f"default: {','.join(map(str, FIRST_SWEEP_LENGTHS))}"},
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print each record as it is measured")


def add_strict(parser: argparse.ArgumentParser) -> None:
    add_options(parser, ["strict", "redraws"])


def add_regressions(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--window", type=typed(functools.partial(parse_count, "--window")), default=5,
        help="earlier runs a run is compared with, 1 or more (default: 5)",
    )  # fmt: skip
    parser.add_argument(
        "--growth", type=typed(functools.partial(parse_positive, "--growth")), default=1.5,
        help="flag a worst error/limit grown past this times the median, a number > 0 (default: 1.5)",
    )  # fmt: skip


def add_reference_form(parser: argparse.ArgumentParser) -> None:
    add_options(parser, ["reference-form"])


def add_isolation(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run each case in a worker process, so a crash or a hang costs that case only "
        "(default: on for GPUs, off on the CPU)",
    )
    add_options(
        parser,
        ["case-timeout"],
        case_timeout=DEFAULT_CASE_TIMEOUT,
        notes={"case-timeout": "with --isolate its worker process is killed and the sweep goes on; without "
               "it the sweep stops there (exit 3)"},
    )  # fmt: skip


def config_from_args(args: argparse.Namespace, console: Console, writes: bool = False) -> RunConfig | None:
    """The run's configuration from a command's options; an option that is not allowed is printed (None), and
    so, for a command that ``writes`` a run, is an output folder it cannot write (full, read-only) or a run
    id that is there already."""
    from kda_conformance.running.config import Grid, build_config  # here: it brings torch

    grid = None
    if hasattr(args, "dtypes"):
        lengths = {"lengths": tuple(args.lengths)} if args.lengths else {}
        seed = args.seed or 0
        grid = Grid(**lengths, dtypes=tuple(args.dtypes), heads=args.heads, head_dim=args.head_dim, seed=seed)
    try:
        keywords = config_keywords(lambda option: getattr(args, option.dest, MISSING))
        config = build_config(
            **keywords
            | dict(
                default_backends=CLI_DEFAULT_BACKENDS,
                seed=getattr(args, "seed", None) or None,  # 0, the first sweep's default, draws a fresh one
                grid=grid,
                isolate=getattr(args, "isolate", None),
                command=args.command_line,
                # `run` with given cases (a repro line pasted) is not a sweep; every other command is its purpose.
                purpose="cases" if getattr(args, "cases", None) else "sweep" if args.command == "run" else args.command,
            )
        )
    except ConfigError as exc:
        say(console, f"{exc}", "error:", "red")
        return None
    problem = config.output_problem() if writes else None
    if problem:
        say(console, f"--out: {problem}", "error:", "red")
        return None
    return config
