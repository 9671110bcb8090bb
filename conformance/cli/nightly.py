"""``kda-conformance nightly``: the night's tests into a store, then the store's dashboard (one command).

The night is the conformance suite's own pytest run (the checks of every registered backend on cases
drawn for the profile, and the corpus) over pytest-xdist workers, the same path AMD CI takes with
``pytest -m gfx950``: a kernel that kills its worker's device context costs that case, and xdist starts
another worker; the workers spread over the GPUs; every worker writes a part of one run, which the store
and the dashboard see whole. ``--shard I/N`` with one ``--run-id`` splits a night over hosts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
from rich.console import Console

from kda_cases.case import Case
from kda_cases.files import atomic_write
from kda_conformance.cli.common import add_out, add_regressions, say
from kda_conformance.cli.dashboard import after_run
from kda_conformance.running.compile import (
    CUT,
    Progress,
    StageInterrupted,
    compile_jobs,
    run_jobs,
    shard_jobs,
    summary,
)
from kda_conformance.running.config import build_config
from kda_conformance.running.faults import is_sticky
from kda_conformance.running.interrupts import STOPPING_VARIABLE, interrupt_tree
from kda_conformance.running.memory import WORKERS_VARIABLE, WorkerPlan, chosen_gpus, device_gib, plan_workers
from kda_conformance.running.option_values import DEFAULT_CASE_TIMEOUT, PURPOSE_VARIABLE, ConfigError
from kda_conformance.running.options import OPTIONS, add_options, pytest_argv
from kda_conformance.running.quarantine import Quarantine
from kda_conformance.running.stages import COMPILE_VARIABLE
from kda_kernels.autotune_replay import RECORD_VARIABLE
from kda_reports.history import read_expected, tonight_departures
from kda_reports.reach import backend_coverage, missed_lines
from kda_reports.runfile import read_run, run_file, run_stem
from kda_reports.store import load_store

CONFORMANCE = Path(__file__).resolve().parent.parent
SUITES = ("test_properties.py", "test_serving.py", "test_corpus.py")
# The line the plugin prints after collecting a shard (pytest_plugin.pytest_report_collectionfinish).
SHARD_PREFIX = "kda-conformance: shard "
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
    "redraws",
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
        "--expected",
        type=Path,
        default=None,
        metavar="FILE",
        help="a team's expected-status file (kda-conformance history --expected): after the night, a cell that "
        "left its expected status fails the night (exit 1) and is named",
    )
    parser.add_argument(
        "--workers",
        default="auto",
        help="pytest-xdist workers: a number, or auto (default: on a GPU, the count its memory holds beside the "
        "night's largest case that runs the most cases at once, conformance/running/memory.py; one per core on a "
        "CPU)",
    )
    parser.add_argument(
        "--compile",
        choices=("auto", "on", "off", "only"),
        default="auto",
        help="compile every (backend, kernel configuration) up front, spread over the workers (auto: on a GPU); "
        "only: the stage alone (as on), then the night file and no tests, to warm a host's Triton cache before a "
        "night or to time the stage, e.g. with KDA_AUTOTUNE_REPLAY=0 and with replay on the same shard's jobs "
        '(exit 1 when a job "failed" or "died", else 0)',
    )
    parser.add_argument(
        "--compile-budget",
        type=float,
        default=None,
        metavar="S",
        help="the compile stage's time budget: past it the stage stops, and the cases of the kernel configurations "
        'it did not compile are skipped ("not compiled") while the rest of the night runs (default: none)',
    )
    parser.add_argument(
        "--time-limit",
        type=_positive_seconds,
        default=None,
        metavar="S",
        help=f"the night's wall-clock limit (a CI job's, a lent machine's): the compile stage gets at most "
        f"{COMPILE_SHARE:.0%}% of it (a smaller --compile-budget stands), and the tests are stopped as Ctrl-C stops "
        f"them {WRITE_SHARE:.0%}% of it (at least {MIN_WRITE_SECONDS:.0f} s) before its end, so that the run, the "
        "night file and the dashboard are written in time; exit 2 when it stopped them (default: none)",
    )
    parser.add_argument(
        "--compile-cache",
        default=None,
        help="Triton's cache folder, kept for the next night on this host (default: TRITON_CACHE_DIR if set, "
        "else OUT/triton-cache)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print each record as it is measured")
    add_regressions(parser)


def pytest_command(args: argparse.Namespace, run_id: str, workers: int | str | None = None) -> list[str]:
    """The night as one pytest command line (the plugin loads itself through ``-p``), the night's options
    passed on from the one table of run options."""
    command = [sys.executable, "-m", "pytest", *(str(CONFORMANCE / name) for name in SUITES)]
    command += ["-p", "kda_conformance.pytest_plugin", "-p", "no:cacheprovider", "--import-mode=importlib", "-q"]
    # The slowest tests in the log: a shard's wall is its longest worker's, and that is where it went.
    command += ["--durations=15", "--durations-min=10"]
    values = {name: getattr(args, OPTIONS[name].dest) for name in PASSED_ON}
    workers = args.workers if workers is None else workers
    command += ["-n", str(workers), *pytest_argv({**values, "out": args.out, "run-id": run_id})]
    return command + (["-v"] if args.verbose else [])


def execute(args: argparse.Namespace, console: Console) -> int:
    expected = None
    if args.expected is not None:  # read before the night: a bad file is a usage error, not a night's end
        try:
            expected = read_expected(args.expected)
        except (OSError, ValueError) as exc:
            say(console, f"--expected: {exc}", "error:", "red")
            return 2
    code = _night(args, console)
    return code if expected is None else _against_expected(args, expected, console, code)


def _against_expected(args: argparse.Namespace, expected: pd.DataFrame, console: Console, code: int) -> int:
    """The night's code, failed where a cell of this run left the status the team expects of it."""
    left = tonight_departures(load_store(args.out), expected)
    for line in left:
        say(console, line, "left its expected status:", "red")
    return 1 if left and code == 0 else code


def _night(args: argparse.Namespace, console: Console) -> int:
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
    problem = config.output_problem(claim=False)  # its pytest claims the run id (it would refuse ours)
    if problem:
        say(console, f"--store: {problem}", "error:", "red")
        return 2
    started = time.monotonic()
    planned = [case for cases in config.planned_cases().values() for case in cases]
    plan = _plan(args, config, planned)
    workers = plan.workers if plan is not None and args.workers == "auto" else args.workers
    workers = int(workers) if str(workers).isdigit() else workers  # --workers N arrives as text
    command = pytest_command(args, config.run_id, workers)
    console.print(f"nightly run {config.run_id}: {shlex.join(command)}", highlight=False, soft_wrap=True)
    for line in config.kernel_config_lines():
        say(console, line)
    cache = Path(args.compile_cache or os.environ.get("TRITON_CACHE_DIR") or Path(args.out) / "triton-cache")
    cache_before = folder_size(cache)
    say(console, f"Triton cache: {cache} ({_size_text(cache_before)}; {'warm' if cache_before[0] else 'cold'})")
    # Triton's disk cache keeps autotuning results too: a kernel configuration one worker tuned is not tuned
    # again by the others, nor by tomorrow's night on the same machine.
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TRITON_CACHE_DIR": str(cache.resolve()),
        "TRITON_CACHE_AUTOTUNING": os.environ.get("TRITON_CACHE_AUTOTUNING", "1"),
        PURPOSE_VARIABLE: "nightly",
    }
    # Every process of the night (its compile stage's too) writes the autotune choices it made: a failure that
    # follows autotune's choice comes back in a sanitize or triage rerun given them (--autotune-replay), not in
    # one that tunes afresh (GLM-5.3-Flash's AMD copy on an H100, the results journal). A folder per part: each
    # host of a sharded night writes its own, of its own GPU model.
    own = Path(args.out) / "autotune" / run_stem(config.run_id, config.part)
    recorded = env.get(RECORD_VARIABLE) or str(own)
    env[RECORD_VARIABLE] = recorded
    say(console, f"autotune choices recorded in {recorded} (sanitize and triage take it as --autotune-replay)")
    if plan is not None:
        say(console, plan.line())
        env[WORKERS_VARIABLE] = str(plan.workers_per_gpu)
    shard_tests, shard_line = _shard_tests(command, env, console) if config.shard is not None else ([], "")
    if shard_line:  # pytest-xdist's controller never collects, so the night's own log would not say it
        say(console, shard_line)
    # Compiling is CPU work outside the memory shares: under --workers auto it takes every process the GPUs'
    # memory holds, which may be more than the workers that run the most cases at once.
    processes = plan.compile_processes if plan is not None and args.workers == "auto" else workers
    compiled = _compile_stage(args, config, planned, env, processes, shard_tests, console)
    # --compile only: the stage alone, no tests (a host's cache warmed before a night, or the stage timed, e.g.
    # with KDA_AUTOTUNE_REPLAY=0 and with replay on the same shard's jobs); its night file says so.
    only = args.compile == "only"
    if compiled:  # the pytest session writes it into the run's timing file (running/stages.py)
        stage = {key: compiled[key] for key in ("seconds", "jobs", "wall_seconds")}
        env[COMPILE_VARIABLE] = json.dumps(stage)
    deadline = None
    if args.time_limit is not None:
        deadline = started + args.time_limit - max(MIN_WRITE_SECONDS, WRITE_SHARE * args.time_limit)
    returncode = 0 if only else _run_pytest(command, env, console, deadline)
    stopped = deadline is not None and not only and time.monotonic() >= deadline
    cache_after = folder_size(cache)
    night = {
        "part": config.part or "",
        "wall_seconds": round(time.monotonic() - started, 3),
        "workers": workers,
        "memory_plan": plan.line() if plan is not None else "",
        **({"shard": shard_line} if shard_line else {}),
        "kernel_configs": len(config.kernel_configs(planned)),
        "compile": compiled,
        "autotune_record": recorded,
        **({"compile_only": True} if only else {}),
        **({"time_limit": args.time_limit, "stopped_at_time_limit": stopped} if args.time_limit is not None else {}),
        "cache": {
            "dir": str(cache),
            "state": "warm" if cache_before[0] else "cold",
            "before": cache_before,
            "after": cache_after,
        },
    }
    _write_night(config, night, console)
    after = "the compile stage" if only else "the night"
    say(console, f"Triton cache after {after}: {cache} ({_size_text(cache_after)})")
    if only:
        return 1 if any(r["outcome"] in ("failed", "died") for r in compiled.get("results", [])) else 0
    _coverage_lines(config, console)
    # pytest's exit codes: 1 when a test failed; an interrupted or broken night is not a kernel failure.
    return after_run(args.out, args.window, args.growth, console, returncode)


def compile_budget(args: argparse.Namespace) -> float | None:
    """The compile stage's budget: --compile-budget, and under --time-limit at most its COMPILE_SHARE."""
    shares = [] if args.time_limit is None else [COMPILE_SHARE * args.time_limit]
    budgets = [b for b in (args.compile_budget, *shares) if b is not None]
    return min(budgets) if budgets else None


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not seconds > 0 or math.isinf(seconds):
        raise argparse.ArgumentTypeError(f"a number of seconds above 0, got {text!r}")
    return seconds


def _plan(args: argparse.Namespace, config, planned: list[Case]) -> WorkerPlan | None:
    """The memory plan of a night on GPUs (None on a CPU: one worker per core)."""
    if config.device.type != "cuda":
        return None
    return plan_workers(device_gib(config.device), len(chosen_gpus(args.gpus)) or 1, planned)


def _shard_tests(command: list[str], env: dict, console: Console) -> tuple[list[str], str]:
    """The node ids of this shard's tests and the plugin's line saying what the shard holds (its backends,
    its share of the night, whose costs): the night's pytest command, collecting only, in one process."""
    collect = [part for i, part in enumerate(command) if part != "-n" and (i == 0 or command[i - 1] != "-n")]
    collect += ["-p", "no:xdist", "--collect-only"]  # with the command's -q: one node id a line
    done = subprocess.run(collect, env=env, capture_output=True, text=True, check=False)
    lines = done.stdout.splitlines()
    nodeids = [line.strip() for line in lines if "::" in line]
    said = next((line.removeprefix("kda-conformance: ") for line in lines if line.startswith(SHARD_PREFIX)), "")
    if done.returncode not in (0, 5) or not nodeids:
        say(console, f"the shard's tests could not be listed (exit {done.returncode})", "warning:", "yellow")
    return nodeids, said


def _compile_stage(
    args: argparse.Namespace,
    config,
    planned: list[Case],
    env: dict,
    workers: int | str,
    shard_tests: list[str],
    console: Console,
) -> dict:
    """Compile every (backend, kernel configuration) of the night before its cases; its numbers for the
    night file and the run's timing (the ``compile`` stage)."""
    on = args.compile in ("on", "only") or (args.compile == "auto" and config.device.type != "cpu")
    if not on:
        reason = "--compile off" if args.compile == "off" else "nothing is compiled on the CPU (Triton interprets)"
        say(console, f"compile stage: skipped ({reason})")
        return {}
    configs = list(config.kernel_configs(planned).values())
    processes = workers if isinstance(workers, int) else (os.cpu_count() or 1)
    if config.shard is None:
        jobs = compile_jobs(config.backends, configs)
        which = f"{len(configs)} kernel configurations x {len(config.backends)} backends"
    else:  # a part of the night on its own host compiles what its own tests need
        drawn_from = config.guaranteed_cases() or configs
        jobs = shard_jobs(shard_tests, planned, drawn_from)
        which = f"the (backend, kernel configuration) pairs of shard {config.part}'s tests"
    say(console, f"compile stage: {which} = {len(jobs)} jobs over {processes} processes")
    began = time.monotonic()
    gpus = chosen_gpus(args.gpus) if config.device.type == "cuda" else []
    progress = Progress(lambda line: say(console, line))
    try:
        with tempfile.TemporaryDirectory(prefix="kda-compile-") as folder:
            # In the night's environment: the compile processes write the cache the night's workers read.
            results = run_jobs(
                jobs, processes, str(config.device), config.plugins, Path(folder), gpus, compile_budget(args), env,
                progress,
            )  # fmt: skip
    except StageInterrupted as stopped:  # what compiled is said and kept in the night file, then the night ends
        done = {**summary(stopped.results, time.monotonic() - began), "results": stopped.results, "interrupted": True}
        say(
            console, f"compile stage interrupted: {len(stopped.results)} of {len(jobs)} jobs done", "warning:", "yellow"
        )
        partial = {"part": config.part or "", "wall_seconds": done["wall_seconds"], "interrupted": True}
        _write_night(config, {**partial, "compile": done}, console)
        raise
    done = {**summary(results, time.monotonic() - began), "results": results}
    _quarantine_crashes(config, jobs, results, console)
    _skip_uncompiled(config, jobs, results, console)
    outcomes = ", ".join(f"{n} {outcome}" for outcome, n in done["outcomes"].items())
    say(console, f"compile stage: {outcomes} in {done['wall_seconds']:.0f} s ({done['seconds']:.0f} s over jobs)")
    for result in results:
        if result["outcome"] in ("failed", "died"):
            message = result["message"].splitlines()[0]
            say(console, f"  {result['job']}: {result['outcome']}: {message}")
    return done


def _skip_uncompiled(config, jobs: list, results: list[dict], console: Console) -> None:
    """The configurations the stage's budget left uncompiled: their cases are skipped ("not compiled"), not
    compiled one by one in the workers while the rest of the night waits."""
    cut = [result for result in results if result["outcome"] == CUT]
    if not cut:
        return
    quarantine = Quarantine(run_file(config.out, config.run_id, config.part, "quarantine"))
    by_key = {job.key: job for job in jobs}
    for result in cut:
        job = by_key[result["job"]]
        quarantine.add(job.backend, job.case, "compile", result["message"], verdict="skip")
    say(console, f"compile stage cut: {len(cut)} (backend, configuration) jobs not compiled; their cases skip")


def _quarantine_crashes(config, jobs: list, results: list[dict], console: Console) -> None:
    """A (backend, configuration) whose compile left the device context dead is quarantined before the cases
    run: on the H200, FLA's 32-token chunk path crashed on 10 of the night's fp32 configurations in the compile
    stage, and each would otherwise have cost a worker (or several, running side by side)."""
    quarantine = Quarantine(run_file(config.out, config.run_id, config.part, "quarantine"))
    by_key = {job.key: job for job in jobs}
    for result in results:
        if result["outcome"] == "died" or (result["outcome"] == "failed" and is_sticky(result["message"])):
            job = by_key[result["job"]]
            quarantine.add(job.backend, job.case, "compile", result["message"])
            say(console, f"quarantined: {result['job']} (its compile crashed: {result['message']})")


def _write_night(config, night: dict, console: Console) -> None:
    """The night file of this part (the compile stage's totals reach the run's timing file through the pytest
    session, which writes it once)."""
    path = run_file(config.out, config.run_id, config.part, "night")
    atomic_write(path, lambda p: p.write_text(json.dumps(night, indent=1)))


def _coverage_lines(config, console: Console) -> None:
    """Per backend: every required axis value reached, or the ones the night missed (reports/reach.py)."""
    records_path = run_file(config.out, config.run_id, config.part, "records")
    if not records_path.exists() or config.profile is None or not config.profile.guaranteed:
        return
    say(console, "required values per backend (cases/coverage.py NIGHT_REQUIRED):")
    for line in missed_lines(backend_coverage(read_run(records_path))):
        say(console, f"  {line}")


def folder_size(folder: Path) -> tuple[int, int]:
    """(files, bytes) under ``folder`` (0, 0 when it does not exist)."""
    files = [p for p in Path(folder).rglob("*") if p.is_file()] if Path(folder).is_dir() else []
    return len(files), sum(p.stat().st_size for p in files)


def _size_text(size: tuple[int, int]) -> str:
    return f"{size[0]} files, {size[1] / 2**20:.0f} MiB"


# How long an interrupted nightly waits for its pytest to say it heard the interrupt too, before passing it on;
# then how long pytest has to stop its workers and merge their parts.
HEARD_WITHIN = 10.0
MERGE_WITHIN = 120.0
# Under --time-limit S: the compile stage's share of S at most, and what is kept back at the end for pytest to
# merge its workers' parts and for the night file and the dashboard (a share of S, at least MIN_WRITE_SECONDS).
COMPILE_SHARE = 0.5
WRITE_SHARE = 0.1
MIN_WRITE_SECONDS = 30.0


def _run_pytest(command: list[str], env: dict[str, str], console: Console, deadline: float | None = None) -> int:
    """pytest's exit code. Interrupted (Ctrl-C, a CI job's time limit), pytest is given the time to stop
    its workers and merge what they measured, so that the dashboard shows the night as far as it got; the
    interrupt is passed on only where pytest did not hear it (running/interrupts.py). At ``deadline`` (a
    ``time.monotonic()`` value: --time-limit) pytest and its workers are interrupted as a Ctrl-C would, and its
    code is returned (2: interrupted)."""
    with tempfile.TemporaryDirectory(prefix="kda-night-") as folder:
        heard = Path(folder) / "stopping"
        process = subprocess.Popen(command, env={**env, STOPPING_VARIABLE: str(heard)})
        try:
            try:
                return process.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                console.print(
                    "time limit: the tests are stopped; pytest is writing the part of the night that ran",
                    highlight=False,
                )
                interrupt_tree(process.pid)
                return _wait_or_kill(process)
        except KeyboardInterrupt:
            console.print("interrupted: pytest is writing the part of the night that ran", highlight=False)
            until = time.monotonic() + HEARD_WITHIN
            while process.poll() is None and not heard.exists() and time.monotonic() < until:
                time.sleep(0.1)
            if process.poll() is None and not heard.exists():  # the interrupt reached this process only
                interrupt_tree(process.pid)
            _wait_or_kill(process)
            return 130


def _wait_or_kill(process: subprocess.Popen) -> int:
    try:
        return process.wait(timeout=MERGE_WITHIN)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()
