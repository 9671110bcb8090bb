"""The run's options, in one table: each option's name, kind, default, environment variable and help.

The command line (``--device``), pytest (``--kda-device``) and the pytest command lines that ``nightly`` and
``detection`` build are all made from this table, so a name, a check or a help text cannot drift between
them. A command may give an option a default of its own (``run`` tests FLA's two kernels unless told; pytest
every registered backend): its help says so. docs/cli.md shows the table.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kda_cases.case import DTYPES
from kda_cases.profiles import PROFILES
from kda_conformance.running.option_values import (
    PROFILE_VARIABLE,
    RUN_ID_VARIABLE,
    SHARD_VARIABLE,
    STRICT_VARIABLE,
    parse_count,
    parse_dtypes,
    parse_head_dim,
    parse_lengths,
    parse_shard,
)
from kda_reference.forms import FORM_VARIABLE, FORMS
from kda_reports.findings import MARGIN_REDRAWS
from kda_reports.runfile import DEFAULT_OUT


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"seconds must be a positive number, got {text!r}") from None
    if not value > 0:
        raise ValueError(f"seconds must be a positive number, got {value}")
    return value


def shard(text: str) -> str:
    parse_shard(text)
    return text


@dataclass(frozen=True)
class Option:
    """One run option. ``name`` is its spelling without dashes: ``--name`` on the command line, ``--kda-name``
    in pytest. ``parse`` turns its text into a value (a ValueError names what is wrong); ``repeat`` options
    collect a list; ``flag`` options take no value."""

    name: str
    help: str
    default: Any = None
    parse: Callable[[str], Any] | None = None
    kind: str = "text"  # how the table shows it: text, number, list, flag, choice, path
    choices: tuple[str, ...] | None = None
    env: str = ""  # the environment variable that sets it where the option is not given
    metavar: str | None = None
    repeat: bool = False
    flag: bool = False
    aliases: tuple[str, ...] = ()  # other command-line spellings, kept for old command lines
    # Whether it is a keyword of the run's configuration (config.build_config, named ``keyword``): every
    # front end hands those over through ``config_keywords``. The first sweep's grid and the GPUs a night
    # spreads over are the front ends' own.
    configures: bool = True

    @property
    def dest(self) -> str:
        return "backends" if self.name == "backend" else self.name.replace("-", "_")

    @property
    def keyword(self) -> str:
        """Its keyword of ``build_config`` (and field of ``RunConfig``)."""
        return "plugins" if self.name == "plugin" else self.dest

    def kwargs(self, default: Any) -> dict[str, Any]:
        """argparse's (and pytest's) keyword arguments for this option with ``default``."""
        help_text = self.help + (f" (also {self.env})" if self.env else "")
        if self.flag:
            return {"action": "store_true", "default": default, "help": help_text, "dest": self.dest}
        kwargs: dict[str, Any] = {"default": default, "help": help_text, "dest": self.dest}
        if self.repeat:
            kwargs["action"] = "append"
        if self.parse is not None:
            kwargs["type"] = typed(self.parse)
        if self.choices is not None:
            kwargs["choices"] = list(self.choices)
        if self.metavar:
            kwargs["metavar"] = self.metavar
        return kwargs


def typed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse type: its ValueError becomes argparse's message naming the option."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


OPTIONS: dict[str, Option] = {
    option.name: option
    for option in (
        Option("device", "device under test: auto (a GPU if torch sees one), cpu, cuda or cuda:N", "auto"),
        Option("backend", "backend to test (repeatable)", kind="list", metavar="NAME", repeat=True),
        Option(
            "plugin",
            "import MODULE (a name, or a .py file's or package folder's path), which registers more backends "
            "(repeatable)",
            [],
            kind="list",
            repeat=True,
            metavar="MODULE",
        ),
        Option(
            "out", "the run store: the folder runs are written to and read from", DEFAULT_OUT, Path, "path",
            metavar="DIR", aliases=("--store",),
        ),
        Option(
            "profile", "sweep profile of the generated cases", None, kind="choice", choices=tuple(PROFILES),
            env=PROFILE_VARIABLE,
        ),
        Option("examples", "cases per check and backend (default: the profile's)", None,
               lambda t: parse_count("examples", t), "number"),
        Option("seed", "seed of a randomized profile's draw (default: a fresh one, printed and recorded), or of the "
               "first sweep's cases (default: 0)",
               None, lambda t: parse_count("seed", t, lowest=0), "number"),
        Option("strict", "warnings (nondeterminism, garbage past the tokens, a known issue that no longer "
               "reproduces) and backends that cannot run fail instead of passing or skipping", None, kind="flag",
               env=STRICT_VARIABLE, flag=True),
        Option("redraws", "fresh draws of a case (new seeds) that judge a failure within 1.5 times its limits again "
               "before it counts; most must fail too, else it is marginal (0: every failure counts at once)",
               MARGIN_REDRAWS, lambda t: parse_count("redraws", t, lowest=0), "number"),
        Option("batch-invariant", "the backends promise batch invariance: a change of earlier outputs within the "
               "chunk of a changed token fails (otherwise it is a warning)", False, kind="flag", flag=True),
        Option("reference-form", "exact form of the float64 truth: auto (the chunked form from a few tokens on), "
               "loop (the token-by-token definition) or chunked", None, kind="choice", choices=FORMS,
               env=FORM_VARIABLE),
        Option("run-id", "the run's id (default: a new one): the shards of one night share one", None,
               env=RUN_ID_VARIABLE),
        Option("shard", "run the I-th of N shares of the tests (hosts of one night)", None, shard, metavar="I/N",
               env=SHARD_VARIABLE),
        Option("gpus", "the GPUs parallel workers spread over, e.g. 0,1 (default: every visible one)", None,
               metavar="LIST", configures=False),
        Option("case-timeout", "seconds a backend's call may take from its start to its return (under "
               "--isolate), or one check once the case's truth is ready; the suite's own work on the case (its "
               "truth, its wait for GPU memory) has its own S, charged to the suite; past it the case is "
               "recorded as hung and its process ends", None, positive_seconds, "number", metavar="S"),
        Option("lengths", "first-sweep sequence lengths, comma-separated", None, parse_lengths, "list",
               configures=False),
        Option("dtypes", f"first-sweep input dtypes, comma-separated ({', '.join(DTYPES)})", None, parse_dtypes,
               "list", configures=False),
        Option("heads", "first-sweep query/key heads (= value heads)", 2, lambda t: parse_count("heads", t),
               "number", configures=False),
        Option(
            "head-dim", "first-sweep K = V (any size a case takes: a backend refuses those its envelope does not)",
            64, parse_head_dim, "number", configures=False,
        ),
    )
}  # fmt: skip

MISSING = object()  # what a front end returns for an option it does not have


def config_keywords(value_of: Callable[[Option], Any]) -> dict[str, Any]:
    """``build_config``'s keyword arguments from one front end's options: each option that configures the run
    and whose value the front end has (``value_of`` gives MISSING for one it lacks: a command that does not
    take ``--profile``). The command line and pytest both hand their options over here, so an option added
    to the table reaches the run's configuration from both."""
    keywords = {}
    for option in OPTIONS.values():
        value = value_of(option) if option.configures else MISSING
        if value is not MISSING:
            keywords[option.keyword] = value
    return keywords


def add_options(
    parser: argparse.ArgumentParser,
    names: Iterable[str],
    notes: Mapping[str, str] | None = None,
    required: Collection[str] = (),
    **defaults: Any,
) -> None:
    """The command-line options ``names`` (``--device``), each with the table's default or ``defaults``'
    (keyed by the option's dest: ``head_dim=128``); ``notes`` adds a command's own words to an option's help
    (its default where the command fills it in later), ``required`` makes options required."""
    notes = notes or {}
    for name in names:
        option = OPTIONS[name]
        default = defaults.get(option.dest, option.default)
        kwargs = option.kwargs(default)
        if name in notes:
            kwargs["help"] += f" ({notes[name]})"
        elif default not in (None, [], False) and "(default" not in option.help:
            shown = ",".join(map(str, default)) if isinstance(default, list | tuple) else default
            kwargs["help"] += f" (default: {shown})"
        if name in required:
            kwargs["required"] = True
        parser.add_argument(f"--{name}", *option.aliases, **kwargs)


def add_pytest_options(group: Any) -> None:
    """Every option as ``--kda-NAME`` in a pytest option group."""
    for name, option in OPTIONS.items():
        kwargs = option.kwargs(option.default)
        kwargs["dest"] = f"kda_{option.dest}"
        group.addoption(f"--kda-{name}", **kwargs)


def pytest_argv(values: Mapping[str, Any]) -> list[str]:
    """``--kda-NAME VALUE`` for each option given (not None; a list repeats the option, a flag is named when
    true), in the table's order: how ``nightly`` and ``detection`` hand their options to pytest."""
    argv: list[str] = []
    for name, option in OPTIONS.items():
        value = values.get(name)
        if value is None or value is False or (option.repeat and not value):
            continue
        if option.flag:
            argv.append(f"--kda-{name}")
        elif option.repeat:
            argv += [arg for item in value for arg in (f"--kda-{name}", str(item))]
        elif isinstance(value, list | tuple):
            argv += [f"--kda-{name}", ",".join(map(str, value))]
        else:
            argv += [f"--kda-{name}", str(value)]
    return argv


def options_markdown() -> str:
    """The table of run options (docs/cli.md)."""
    lines = [
        "| command line | pytest | kind | default | environment | what it does |",
        "|---|---|---|---|---|---|",
    ]
    for name, option in OPTIONS.items():
        spellings = ", ".join(f"`{s}`" for s in (f"--{name}", *option.aliases))
        default = "" if option.default in (None, [], False) else f"`{option.default}`"
        env = f"`{option.env}`" if option.env else ""
        lines.append(f"| {spellings} | `--kda-{name}` | {option.kind} | {default} | {env} | {option.help} |")
    return "\n".join(lines) + "\n"
