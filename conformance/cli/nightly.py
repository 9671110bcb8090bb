"""``kda-conformance nightly``: the night's tests into a store, then the store's dashboard (one command).

The night is the conformance suite's own pytest run (the checks of every registered backend on cases
drawn for the profile, and the corpus) over pytest-xdist workers, the same path AMD CI takes with
``pytest -m gfx950``: a kernel that kills its worker's device context costs that case, and xdist starts
another worker; the workers spread over the GPUs; every worker writes a part of one run, which the store
and the dashboard see whole. ``--shard I/N`` with one ``--run-id`` splits a night over hosts.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from kda_conformance.cli.common import add_out, add_regressions, say
from kda_conformance.cli.dashboard import after_run
from kda_conformance.running.config import DEFAULT_CASE_TIMEOUT, ConfigError, build_config
from kda_conformance.running.options import OPTIONS, add_options, pytest_argv

NAME = "nightly"
HELP = "the nightly job: the night's tests over parallel workers into a store, then the dashboard"
CONFORMANCE = Path(__file__).resolve().parent.parent
SUITES = ("test_properties.py", "test_serving.py", "test_corpus.py")
EXAMPLE = "kda-conformance nightly --out /srv/kda-store --device cuda --backend fla_chunk --backend fla_recurrent"


# The run options the night takes (running/options.py), handed to its pytest run as --kda-NAME.
PASSED_ON = (
    "device",
    "plugin",
    "backend",
    "profile",
    "examples",
    "seed",
    "gpus",
    "shard",
    "run-id",
    "case-timeout",
    "strict",
    "reference-form",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_out(parser, required=True)
    add_options(
        parser,
        PASSED_ON,
        profile="nightly",
        case_timeout=DEFAULT_CASE_TIMEOUT,
        notes={"backend": "default: every registered backend"},
    )
    parser.add_argument(
        "--workers", default="auto", help="pytest-xdist workers: a number, or auto (one per core; default)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print each record as it is measured")
    add_regressions(parser)


def pytest_command(args: argparse.Namespace, run_id: str) -> list[str]:
    """The night as one pytest command line (the plugin loads itself through ``-p``), the night's options
    passed on from the one table of run options."""
    command = [sys.executable, "-m", "pytest", *(str(CONFORMANCE / name) for name in SUITES)]
    command += ["-p", "kda_conformance.plugin", "-p", "no:cacheprovider", "--import-mode=importlib", "-q"]
    values = {name: getattr(args, OPTIONS[name].dest) for name in PASSED_ON}
    command += ["-n", str(args.workers), *pytest_argv({**values, "out": args.out, "run-id": run_id})]
    return command + (["-v"] if args.verbose else [])


def execute(args: argparse.Namespace, console: Console) -> int:
    try:  # the options are checked here, before a night of workers starts on them
        config = build_config(
            device=args.device,
            backends=args.backends,
            plugins=args.plugin,
            profile=args.profile,
            examples=args.examples,
            seed=args.seed,
            out=args.out,
            reference_form=args.reference_form,
            run_id=args.run_id,
            shard=args.shard,
            strict=args.strict,
        )
    except ConfigError as exc:
        say(console, f"{exc}", "error:", "red")
        return 2
    problem = config.output_problem()
    if problem:
        say(console, f"--store: {problem}", "error:", "red")
        return 2
    command = pytest_command(args, config.run_id)
    console.print(f"nightly run {config.run_id}: {shlex.join(command)}", highlight=False, soft_wrap=True)
    # Triton's disk cache keeps autotuning results too: a kernel configuration one worker tuned is not tuned
    # again by the others, nor by tomorrow's night on the same machine.
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TRITON_CACHE_AUTOTUNING": os.environ.get("TRITON_CACHE_AUTOTUNING", "1"),
    }
    returncode = _run_pytest(command, env, console)
    # pytest's exit codes: 1 when a test failed; an interrupted or broken night is not a kernel failure.
    return after_run(args.out, args.window, args.growth, console, returncode)


def _run_pytest(command: list[str], env: dict[str, str], console: Console) -> int:
    """pytest's exit code. Interrupted (Ctrl-C, a CI job's time limit), pytest is given the time to stop
    its workers and merge what they measured, so that the dashboard shows the night as far as it got."""
    process = subprocess.Popen(command, env=env)
    try:
        return process.wait()
    except KeyboardInterrupt:
        console.print("interrupted: pytest is writing the part of the night that ran", highlight=False)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:  # the interrupt reached this process only: pass it on
            process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
        return 130
