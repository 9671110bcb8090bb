"""``kda-conformance checks``: the registered checks as a table (docs/checks.md is its output), or, with
``--run``, every check on one case per backend, as a table of what each check observed (the table of
docs/serving.md).

The case is one served batch moved into each backend's envelope (``Backend.fit``): packed sequences with a
zero-length member, an initial state, checkpoints; so each backend compiles one kernel configuration.
Every parameter a check draws is fixed: the split point mid-sequence, each poison mode in turn.

On a GPU the backends run side by side, each in a process of its own (``--workers``): most of a cold
machine's time is each backend's Triton compile, which is CPU-bound and one backend's at a time in one
process. Every process writes a part of one run, merged as a night's workers' parts are.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
from rich.console import Console

from kda_cases.case import Case
from kda_cases.files import atomic_write_text
from kda_conformance.checks import CHECKS, run_check
from kda_conformance.cli.common import add_backends, add_device, add_out, config_from_args, parse_case, say, typed
from kda_conformance.cli.exits import PASSED, verdict_exit
from kda_conformance.judging.judge import judge_for
from kda_conformance.running.blame import fault_finding
from kda_conformance.running.config import RunConfig
from kda_conformance.running.faults import DeviceLost
from kda_conformance.running.option_values import PURPOSE_VARIABLE, RUN_ID_VARIABLE, parse_count
from kda_conformance.running.run import Run
from kda_kernels import guard, registry
from kda_kernels.guard import BackendFault
from kda_kernels.serving import POISON_MODES

# Three packed sequences (one empty) crossing 64-token chunks and a 32-token one, an initial state, and
# checkpoints on and off the 16-token grid: every serving pattern has something to bite on.
TABLE_CASE = Case(
    seq_lens=(150, 0, 97),
    packed=True,
    num_heads=4,
    num_v_heads=4,
    head_k_dim=128,
    head_v_dim=128,
    initial_state="random",
    checkpoints=((0, 64), (0, 100), (2, 33)),
    seed=20261130,
)
EXAMPLE = "kda-conformance checks --run --device cpu --backend torch_chunk"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--table", type=Path, default=None, help="also write the markdown to this file")
    parser.add_argument("--run", action="store_true", help="run every check on one case per backend")
    add_device(parser)
    add_out(parser)
    add_backends(parser, default="fla_chunk and fla_recurrent")
    parser.add_argument(
        "--case", type=typed(parse_case), default=None, metavar="JSON_OR_FILE", help="with --run: the case"
    )
    parser.add_argument(
        "--workers",
        type=typed(lambda text: parse_count("--workers", text)),
        default=None,
        help="with --run: how many backends run side by side, each in a process of its own (default: every "
        "backend at once, up to the cores, on a GPU; one after another in this process on a CPU)",
    )
    # A side-by-side process: the part of the run it writes, and the file its table rows go to.
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=Path, default=None, help=argparse.SUPPRESS)


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


def _params(name: str, case: Case) -> list[dict]:
    """Every value of the check's parameters worth a row: the split point mid-sequence, each poison."""
    if name in ("split_resume", "prefix"):
        return [{"at": case.max_len // 2 + 1}]
    if name == "poison":
        return [{"poison": mode} for mode in POISON_MODES if mode != "none"]
    return [{}]


def run_table(run: Run, case: Case, console: Console) -> pd.DataFrame:
    """Every check on ``case`` for every backend of ``run``, the case moved into each backend's envelope and
    prepared for each check (the budget check's too), each through the run's executor and recorded."""
    rows, device = [], run.config.device
    for name in run.config.backends:
        backend = registry.get(name)
        for check in CHECKS.values():
            try:
                available = guard.availability(backend, device)
                fitted = check.prepare(guard.fit(backend, case), backend)
                supported = guard.supports(backend, fitted)
            except BackendFault as fault:
                judge = judge_for(check.name, case, name, device)
                run.record([fault_finding(judge, fault)])
                rows.append(_row(name, check.name, "", "", "error", fault.reason))
                continue
            reason = available.reason if not available else check.applies(backend, device.type) or supported.reason
            if not available or not supported or reason:
                rows.append(_row(name, check.name, "", "", "skip", reason))
                continue
            for params in _params(check.name, fitted):
                shown = "".join(f" --{key} {value}" for key, value in params.items())
                console.print(f"checking {name}: {check.name}{shown}", highlight=False)
                try:
                    findings = run_check(check, fitted, backend, device, params, run)  # what raises is a finding
                except DeviceLost as lost:  # a sticky device error: this process can run nothing more
                    run.record(lost.findings)
                    say(console, f"{lost}", "stopped:", "red")
                    return pd.DataFrame([*rows, *_rows(name, check.name, "", lost.findings)], columns=COLUMNS)
                run.record(findings)
                rows += _rows(name, check.name, shown, findings)
                # Each failure's line to rerun it, once per check and parameters.
                for repro in dict.fromkeys(f.repro for f in findings if f.failed and f.repro):
                    say(console, repro, f"FAIL {name} {check.name}{shown}; repro:", "red")
    return pd.DataFrame(rows, columns=COLUMNS)


COLUMNS = ["backend", "check", "what", "observed", "verdict", "note"]


def side_by_side(
    args: argparse.Namespace, config: RunConfig, workers: int, console: Console
) -> tuple[pd.DataFrame, dict[str, Path]]:
    """Each backend's checks in a process of its own, ``workers`` at once, each writing a part of this run
    (merged into the run's files at the end); the table rows in the backends' order. A process that ends
    without its rows (killed, crashed outside a check) is an error row naming its exit and its last words."""
    scratch = tempfile.TemporaryDirectory(prefix="kda-checks-")  # each process's rows and log, gone at the end
    folder = Path(scratch.name)
    env = {**os.environ, RUN_ID_VARIABLE: config.run_id, PURPOSE_VARIABLE: "checks"}
    running: set[subprocess.Popen] = set()
    say(console, f"checks of {len(config.backends)} backends side by side, {workers} processes at once")

    def one(index: int, name: str) -> pd.DataFrame:
        rows_file, log = folder / f"rows-{index}.json", folder / f"{name}.log"
        command = [sys.executable, "-m", "kda_conformance.cli", "checks", "--run", "--device", str(config.device)]
        command += ["--out", str(config.out), "--backend", name, "--worker", f"gw{index}", "--rows", str(rows_file)]
        command += [arg for module in config.plugins for arg in ("--plugin", module)]
        command += ["--case", args.case.to_json()] if args.case is not None else []
        began = time.monotonic()
        with log.open("w") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
            running.add(process)
            code = process.wait()
            running.discard(process)
        say(console, f"checks of {name}: exit {code} in {time.monotonic() - began:.0f} s")
        if rows_file.exists():
            return pd.DataFrame(json.loads(rows_file.read_text()), columns=COLUMNS)
        words = " ".join(log.read_text(errors="replace").split()[-40:])
        return pd.DataFrame([_row(name, "", "", "", "error", f"its process ended with exit {code}: {words}")])

    pool = ThreadPoolExecutor(workers)
    complete = False
    try:
        tables = list(pool.map(one, range(len(config.backends)), config.backends))
        complete = True
    except BaseException:  # interrupted: the processes still running end too, and what the others wrote is kept
        for process in list(running):
            process.terminate()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        scratch.cleanup()
        written = Run(config).merge_workers(complete=complete)
    return pd.concat(tables, ignore_index=True), written


def _rows(backend: str, check: str, shown: str, findings: list) -> list[dict[str, str]]:
    """One table row per finding of a check (``shown``: its parameters as options)."""
    rows = []
    for f in findings:
        what = (f"{shown.strip()} " if shown else "") + f"{f.subject} {f.tensor}".strip()
        rows.append(_row(backend, check, what, f.observed, f.verdict, "; ".join(f.problems) or f.reason))
    return rows


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """One row per backend x check x observation x verdict: how many findings, and the first one's note."""
    grouped = table.groupby(["backend", "check", "observed", "verdict"], sort=False)
    return grouped.agg(findings=("what", "size"), note=("note", "first")).reset_index()


def _row(*values: str) -> dict[str, str]:
    row = dict(zip(COLUMNS, values, strict=True))
    # A table cell, not a log (the records keep the whole of it): shortened at a word, saying so.
    row["note"] = textwrap.shorten(row["note"], 200, placeholder=" ...")
    return row


def execute(args: argparse.Namespace, console: Console) -> int:
    if not args.run:
        text = checks_markdown()
    else:
        args.plugin = args.plugin or []
        config = config_from_args(args, console, writes=args.worker is None)
        if config is None:
            return 2
        case = args.case or TABLE_CASE
        workers = args.workers or (min(len(config.backends), os.cpu_count() or 1) if config.device.type != "cpu" else 1)
        if args.worker is None and workers > 1 and len(config.backends) > 1:
            rows, written = side_by_side(args, config, workers, console)
        else:
            run = Run(config, worker=args.worker)
            try:
                rows = run_table(run, case, console)
            finally:
                written = run.finish(complete=True)
            if args.rows is not None:
                atomic_write_text(args.rows, json.dumps(rows.to_dict(orient="records")))
        if "records" in written:
            console.print(f"records: {written['records']}", highlight=False)
        code = verdict_exit(rows["verdict"], config.strict)
        table = summary(rows)
        text = (
            f"Produced by `{args.command_line}` on {config.environment().get('device_name', '')}: every check "
            f"on case {case.id} ({case.label}), moved into each backend's envelope; one row per backend, "
            "check, observation and verdict, with how many findings it holds and the first one's note.\n\n"
            + table.to_markdown(index=False)
            + "\n"
        )
    console.print(text, markup=False, highlight=False, soft_wrap=True)
    if args.table is not None:
        atomic_write_text(args.table, text)
    return code if args.run else PASSED
