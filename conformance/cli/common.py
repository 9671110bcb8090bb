"""What several commands share: option groups, the case argument, and turning options into a RunConfig."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.text import Text

from kda_cases.case import Case
from kda_cases.corpus import load_corpus
from kda_cases.grids import FIRST_SWEEP_LENGTHS
from kda_conformance.checks import CHECKS
from kda_conformance.checks.registry import Check, Param
from kda_conformance.running.config import (
    DEFAULT_CASE_TIMEOUT,
    ConfigError,
    Grid,
    RunConfig,
    build_config,
    parse_choices,
    parse_count,
    parse_dtypes,
    parse_head_dim,
    parse_lengths,
)
from kda_reference.run import FORMS
from kda_reports.runfile import DEFAULT_OUT

CLI_DEFAULT_BACKENDS = ("fla_chunk", "fla_recurrent")


def typed(parse: Callable[[str], object]) -> Callable[[str], object]:
    """``parse`` as an argparse type: its ValueError becomes argparse's message naming the option."""

    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def choices(what: str, allowed: tuple[str, ...]) -> Callable[[str], object]:
    return typed(lambda text: parse_choices(what, text, allowed))


def parse_case(text: str) -> Case:
    """A case from JSON text, a .json file holding it, or the id of a pinned corpus case."""
    stripped = text.strip()
    if stripped.startswith("kda-") and "{" not in stripped and not Path(stripped).is_file():
        for entry in load_corpus():
            if entry.case.id == stripped:
                return entry.case
        raise ValueError(
            f"case id {stripped} is not in the corpus; pass the case JSON instead (every failure prints it)"
        )
    source = stripped
    if not stripped.startswith("{"):
        if not Path(stripped).is_file():
            raise ValueError(f"--case takes case JSON, a .json file or a corpus id; {text!r} is none of them")
        source = Path(stripped).read_text()
    try:
        data = json.loads(source)
        if isinstance(data, dict) and isinstance(data.get("case"), dict) and "why" in data:
            data = data["case"]  # a corpus entry (cases/corpus/*.json): the case it pins
        return Case.from_dict(data) if isinstance(data, dict) else Case.from_json(source)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"--case: not a valid case: {exc}") from None


def say(console: Console, text: str, label: str = "", style: str = "") -> None:
    """One line on the console, printed as it is: text from kernels, cases and users (a tag, a reason, a
    case's JSON) is never read as rich markup; ``label`` goes before it in ``style``."""
    line = Text(f"{label} ", style=style) + Text(text) if label else Text(text)
    console.print(line, highlight=False, soft_wrap=True)


def add_device(parser: argparse.ArgumentParser, default: str = "auto") -> None:
    parser.add_argument("--device", default=default, help=f"auto, cpu, cuda or cuda:N (default: {default})")


def add_backends(parser: argparse.ArgumentParser, default: str = "fla_chunk and fla_recurrent") -> None:
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE, which registers more backends (repeatable)",
    )
    parser.add_argument(
        "--backend",
        action="append",
        dest="backends",
        metavar="NAME",
        help=f"backend to test, repeatable (default: {default})",
    )


def add_check_params(parser: argparse.ArgumentParser) -> None:
    """Every parameter a registered check draws as an option (``--at 17``), so every repro line can be
    rerun (``repro``, ``minimize``)."""
    for param in check_params().values():
        parser.add_argument(
            f"--{param.name}", type=typed(param.parse), choices=param.choices, default=None, help=param.help
        )


def check_params() -> dict[str, Param]:
    """The parameters the registered checks draw, by name."""
    return {p.name: p for check in CHECKS.values() for p in check.params}


def missing_params(check: Check, params: dict[str, object], console: Console) -> bool:
    """Say which of ``check``'s parameters were not given; True when any is missing."""
    missing = [name for name, value in params.items() if value is None]
    if missing:
        say(console, f"check {check.name} needs " + ", ".join(f"--{name}" for name in missing), "error:", "red")
    return bool(missing)


def add_out(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: ./out)")


def add_grid(parser: argparse.ArgumentParser, default_dtypes: tuple[str, ...]) -> None:
    parser.add_argument(
        "--lengths",
        type=typed(parse_lengths),
        default=None,
        help=f"sequence lengths (default: {','.join(map(str, FIRST_SWEEP_LENGTHS))})",
    )
    parser.add_argument(
        "--dtypes",
        type=typed(parse_dtypes),
        default=default_dtypes,
        help=f"input dtypes (default: {','.join(default_dtypes)})",
    )
    parser.add_argument(
        "--heads",
        type=typed(lambda text: parse_count("heads", text)),
        default=2,
        help="query/key heads (= value heads) per case (default: 2)",
    )
    parser.add_argument(
        "--head-dim",
        type=typed(parse_head_dim),
        default=64,
        help="K = V head dimension, a multiple of 16 up to 256 (default: 64)",
    )
    parser.add_argument(
        "--seed",
        type=typed(lambda text: parse_count("seed", text, lowest=0)),
        default=None,
        help="the cases' seed: the grid's inputs, or a profile's draw (default: 0 for the grid, fresh for a profile)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print each record as it is measured")


def add_strict(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--strict",
        action="store_true",
        default=None,
        help="warnings (nondeterminism, garbage past the tokens, a known issue that no longer reproduces) and "
        "backends that cannot run fail the run instead of passing or skipping (also KDA_STRICT=1)",
    )


def add_regressions(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--window", type=int, default=5, help="earlier runs a run is compared with (default: 5)")
    parser.add_argument(
        "--growth",
        type=float,
        default=1.5,
        help="flag a worst error/limit grown past this times the median (default: 1.5)",
    )


def add_reference_form(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--reference-form",
        choices=FORMS,
        default=None,
        help="exact form of the float64 truth: auto (default: the chunked form from a few tokens on), "
        "loop (the token-by-token definition) or chunked",
    )


def add_isolation(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run each case in a worker process, so a crash or a hang costs that case only "
        "(default: on for GPUs, off on the CPU)",
    )
    parser.add_argument(
        "--case-timeout",
        type=float,
        default=DEFAULT_CASE_TIMEOUT,
        metavar="S",
        help=f"seconds one case may take on one backend (default: {DEFAULT_CASE_TIMEOUT:g}); past it the case is "
        "recorded as hung: with --isolate its worker process is killed and the sweep goes on, without it the sweep "
        "stops there (exit 3)",
    )


def config_from_args(args: argparse.Namespace, console: Console, writes: bool = False) -> RunConfig | None:
    """The run's configuration from a command's options; an option that is not allowed is printed (None), and
    so, for a command that ``writes`` a run, is an output folder it cannot write (full, read-only) or a run
    id that is there already."""
    grid = None
    if hasattr(args, "dtypes"):
        lengths = {"lengths": tuple(args.lengths)} if args.lengths else {}
        seed = args.seed or 0
        grid = Grid(**lengths, dtypes=tuple(args.dtypes), heads=args.heads, head_dim=args.head_dim, seed=seed)
    try:
        config = build_config(
            device=args.device,
            backends=args.backends,
            default_backends=CLI_DEFAULT_BACKENDS,
            plugins=args.plugin,
            profile=getattr(args, "profile", None),
            examples=getattr(args, "examples", None),
            seed=getattr(args, "seed", None) or None,
            grid=grid,
            out=getattr(args, "out", DEFAULT_OUT),
            reference_form=getattr(args, "reference_form", None),
            isolate=getattr(args, "isolate", None),
            case_timeout=getattr(args, "case_timeout", None),
            strict=getattr(args, "strict", None),
            command=args.command_line,
        )
    except ConfigError as exc:
        say(console, f"{exc}", "error:", "red")
        return None
    problem = config.output_problem() if writes else None
    if problem:
        say(console, f"--out: {problem}", "error:", "red")
        return None
    return config
