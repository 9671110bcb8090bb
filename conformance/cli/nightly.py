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
import signal
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from kda_cases.profiles import PROFILES
from kda_conformance.cli.common import add_backends, add_device, add_reference_form, add_regressions, add_strict, say
from kda_conformance.cli.dashboard import after_run
from kda_conformance.running.config import ConfigError, build_config

NAME = "nightly"
HELP = "the nightly job: the night's tests over parallel workers into a store, then the dashboard"
CONFORMANCE = Path(__file__).resolve().parent.parent
SUITES = ("test_properties.py", "test_serving.py", "test_corpus.py")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", type=Path, required=True, help="the run store (a folder kept between nights)")
    add_device(parser)
    add_backends(parser, default="every registered backend")
    parser.add_argument("--profile", choices=list(PROFILES), default="nightly", help="sweep profile (default: nightly)")
    parser.add_argument(
        "--examples", type=int, default=None, help="cases per check and backend (default: the profile's)"
    )
    parser.add_argument("--seed", type=int, default=None, help="the draw's seed (default: a fresh one, recorded)")
    parser.add_argument(
        "--workers", default="auto", help="pytest-xdist workers: a number, or auto (one per core; default)"
    )
    parser.add_argument("--gpus", default=None, metavar="LIST", help="the GPUs the workers spread over (default: all)")
    parser.add_argument("--shard", default=None, metavar="I/N", help="run the I-th of N shares (hosts of one night)")
    parser.add_argument(
        "--run-id", default=None, help="the run's id (default: a new one; the shards of a night share one)"
    )
    parser.add_argument(
        "--case-timeout",
        type=float,
        default=900.0,
        metavar="S",
        help="seconds one check of one case may take (default: 900)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print each record as it is measured")
    add_strict(parser)
    add_regressions(parser)
    add_reference_form(parser)


def pytest_command(args: argparse.Namespace, run_id: str) -> list[str]:
    """The night as one pytest command line (the plugin loads itself through ``-p``)."""
    command = [sys.executable, "-m", "pytest", *(str(CONFORMANCE / name) for name in SUITES)]
    command += ["-p", "kda_conformance.plugin", "-p", "no:cacheprovider", "--import-mode=importlib", "-q"]
    command += ["-n", str(args.workers), "--kda-device", args.device, "--kda-profile", args.profile]
    command += ["--kda-out", str(args.store), "--kda-run-id", run_id, "--kda-case-timeout", str(args.case_timeout)]
    options = {
        "--kda-seed": args.seed,
        "--kda-examples": args.examples,
        "--kda-gpus": args.gpus,
        "--kda-shard": args.shard,
        "--kda-reference-form": args.reference_form,
    }
    command += [arg for option, value in options.items() if value is not None for arg in (option, str(value))]
    command += [arg for module in args.plugin for arg in ("--kda-plugin", module)]
    command += [arg for name in args.backends or () for arg in ("--kda-backend", name)]
    command += ["--kda-strict"] if args.strict else []
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
            out=args.store,
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
    console.print(f"nightly run {config.run_id}: " + " ".join(command[1:]), highlight=False, soft_wrap=True)
    # Triton's disk cache keeps autotuning results too: a kernel configuration one worker tuned is not tuned
    # again by the others, nor by tomorrow's night on the same machine.
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TRITON_CACHE_AUTOTUNING": os.environ.get("TRITON_CACHE_AUTOTUNING", "1"),
    }
    returncode = _run_pytest(command, env, console)
    # pytest's exit codes: 1 when a test failed; an interrupted or broken night is not a kernel failure.
    return after_run(args.store, args.window, args.growth, console, returncode)


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
