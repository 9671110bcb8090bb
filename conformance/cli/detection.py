"""``kda-conformance detection``: run the checks and the corpus for some backends (say, planted bugs) in one
pytest process and tabulate what caught each (reports/detection.py)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from rich.console import Console

from kda_cases.coverage import coverage_markdown
from kda_cases.files import atomic_write_text
from kda_cases.profiles import PROFILES
from kda_conformance.checks import CHECKS
from kda_conformance.cli.common import say
from kda_conformance.running.option_values import PURPOSE_VARIABLE, parse_count
from kda_conformance.running.options import pytest_argv, typed
from kda_kernels import registry
from kda_reports.detection import detection_markdown, detection_problems, detection_table, detection_verdict
from kda_reports.runfile import DEFAULT_OUT, read_run, record_coverage

CONFORMANCE = Path(__file__).resolve().parent.parent
SUITES = ("test_properties.py", "test_serving.py", "test_corpus.py")
EXAMPLE = "PYTHONPATH=tests/plugins kda-conformance detection --plugin kda_planted_bugs --correct torch_chunk"


@dataclass(frozen=True)
class DetectionRun:
    table: pd.DataFrame  # one row per backend
    entries: dict[str, dict]  # pytest node id -> check, backend, examples, failed_at, findings
    returncode: int
    output: str
    command: list[str]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plugin", action="append", default=[], metavar="MODULE", help="module that registers backends (repeatable)"
    )
    parser.add_argument(
        "--backend",
        action="append",
        dest="backends",
        metavar="NAME",
        help="backend to run, repeatable (default: every backend the plugins register)",
    )
    parser.add_argument(
        "--plugin-backends", action="store_true", help="with --backend: also every backend the plugins register"
    )
    parser.add_argument(
        "--planted",
        action="append",
        default=[],
        metavar="NAME",
        help="a planted bug to run, which must be caught (repeatable; default: every plugin backend that is not "
        "a correct control)",
    )
    parser.add_argument(
        "--correct",
        action="append",
        default=[],
        metavar="NAME",
        help="a correct control, which must pass (repeatable; a plugin backend too; also a backend class with "
        "correct_control = True)",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="a warning (nondeterminism, garbage past the tokens) fails its test, so it counts as a catch",
    )
    parser.add_argument("--profile", choices=list(PROFILES), default="ci", help="sweep profile (default: ci)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    seed, count = functools.partial(parse_count, "--seed", lowest=0), functools.partial(parse_count, "--examples")
    parser.add_argument("--seed", type=typed(seed), default=None, help="seed of a randomized profile")
    parser.add_argument(
        "--examples",
        type=typed(count),
        default=None,
        metavar="N",
        help="cases per check and backend (default: the profile's)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: ./out)")
    parser.add_argument("--table", type=Path, default=None, help="also write the markdown table to this file")


def pytest_command(
    backends: list[str],
    plugins: list[str],
    profile: str,
    device: str,
    out: Path,
    seed: int | None = None,
    strict: bool = False,
    examples: int | None = None,
) -> list[str]:
    """The pytest command line the detection run uses (the plugin loads itself through ``-p``), its options
    from the one table of run options."""
    command = [sys.executable, "-m", "pytest", *(str(CONFORMANCE / name) for name in SUITES)]
    command += ["-q", "-p", "kda_conformance.pytest_plugin", "-p", "no:cacheprovider", "--import-mode=importlib"]
    values = {"device": device, "profile": profile, "out": out, "plugin": plugins, "backend": backends}
    return command + pytest_argv({**values, "seed": seed, "strict": strict, "examples": examples})


def run_detection(
    backends: list[str],
    plugins: list[str],
    out: Path,
    profile: str = "ci",
    device: str = "cpu",
    seed: int | None = None,
    env: dict[str, str] | None = None,
    echo: Callable[[str], None] | None = None,
    strict: bool = False,
    examples: int | None = None,
) -> DetectionRun:
    """Run the checks and the corpus for ``backends`` and tabulate what caught each; ``echo`` gets pytest's
    output line by line as it comes (its progress), for a run that takes minutes; ``strict``: warnings fail."""
    command = pytest_command(backends, plugins, profile, device, out, seed, strict, examples)
    lines = []
    env = {**(os.environ if env is None else env), PURPOSE_VARIABLE: "detection"}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as process:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if echo is not None:
                echo(line.rstrip("\n"))
    output = "".join(lines)
    files = sorted((Path(out) / "runs").glob("*.checks.json"))
    if not files:
        raise RuntimeError(f"the detection run wrote no checks file (exit {process.returncode}):\n{output[-3000:]}")
    entries = json.loads(files[-1].read_text())
    titles = {name: check.title for name, check in CHECKS.items()}
    runs = sorted((Path(out) / "runs").glob("*.parquet"), key=lambda p: p.stat().st_mtime)
    records = read_run(runs[-1]) if runs else None
    table = detection_table(entries, backends, titles, records)
    return DetectionRun(table, entries, process.returncode, output, command)


def execute(args: argparse.Namespace, console: Console) -> int:
    try:
        before = set(registry.names())
        for module in args.plugin:
            registry.load_plugin(module)
        from_plugins = sorted(set(registry.names()) - before)
        correct = [*(args.backends or []), *args.correct]
        if args.planted:
            planted = list(args.planted)
        else:  # every plugin backend, unless --backend names the correct ones without --plugin-backends
            planted = from_plugins if (args.plugin_backends or not args.backends) else []
        correct += [n for n in planted if getattr(registry.get(n), "correct_control", False)]
        planted = [n for n in planted if n not in correct]
        names = list(dict.fromkeys([*correct, *planted]))
        backends = {name: registry.get(name) for name in names}
    except (KeyError, registry.PluginError) as exc:
        say(console, f"{exc.args[0]}", "error:", "red")
        return 2
    if not names:
        say(console, "no backends: name them with --backend, or load a plugin that registers some", "error:", "red")
        return 2
    console.print(
        f"detection: {len(planted)} planted, {len(names) - len(planted)} correct backends, profile {args.profile}, "
        f"device {args.device}; pytest's progress follows",
        highlight=False,
    )
    run = run_detection(
        names,
        args.plugin,
        args.out,
        args.profile,
        args.device,
        args.seed,
        echo=lambda line: print(line, flush=True),
        strict=args.strict,
        examples=args.examples,
    )
    markdown = detection_markdown(run.table, {n: b.description for n, b in backends.items()}, args.command_line)
    runs = sorted((Path(args.out) / "runs").glob("*.parquet"), key=lambda p: p.stat().st_mtime)
    if runs:  # the run just written: which axis values its cases reached
        reached = coverage_markdown(record_coverage(read_run(runs[-1])))
        markdown += "\n## Axis coverage of the run's cases\n\nDistinct cases per value (cases/coverage.py).\n\n"
        markdown += reached + "\n"
    console.print(markdown, markup=False, highlight=False, soft_wrap=True)
    if args.table is not None:
        atomic_write_text(args.table, markdown)
    problems = detection_problems(run.table, planted)
    for problem in problems:
        say(console, f"{problem}", "detection:", "red")
    say(console, detection_verdict(run.table, planted), "detection:", "red" if problems else "green")
    return 1 if problems else 0
