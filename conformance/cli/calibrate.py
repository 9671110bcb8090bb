"""``kda-conformance calibrate``: error/limit ratios over the calibration grid, as a committed table."""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
from rich.console import Console

from kda_cases.case import GATE_REGIMES, INITIAL_STATES
from kda_cases.files import atomic_write_text
from kda_cases.grids import CALIBRATION_GATE_REGIMES, CALIBRATION_INITIAL_STATES, FIRST_SWEEP_LENGTHS, calibration_cases
from kda_conformance.cli.common import add_backends, add_device, add_grid, add_out, choices, config_from_args, say
from kda_conformance.cli.exits import INTERRUPTED, verdict_exit
from kda_conformance.cli.sweep import sweep
from kda_conformance.running.run import Run
from kda_reports.calibration import calibration_markdown, calibration_table
from kda_reports.findings import grouped_failures
from kda_reports.runfile import read_run

EXAMPLE = "kda-conformance calibrate --device cuda --backend fla_chunk --lengths 37,2048 --table docs/calibration.md"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_out(parser)
    add_device(parser)
    add_backends(parser)
    add_grid(parser, default_dtypes=("bf16", "fp16", "fp32"))
    parser.add_argument(
        "--gate-regimes",
        type=choices("gate regimes", GATE_REGIMES),
        default=CALIBRATION_GATE_REGIMES,
        help=f"e.g. typical,weak (default: {','.join(CALIBRATION_GATE_REGIMES)})",
    )
    parser.add_argument(
        "--initial-states",
        type=choices("initial states", INITIAL_STATES),
        default=CALIBRATION_INITIAL_STATES,
        help=f"e.g. none,random (default: {','.join(CALIBRATION_INITIAL_STATES)})",
    )
    parser.add_argument("--table", type=Path, default=None, help="also write the markdown table to this file")
    parser.add_argument(
        "--records",
        type=Path,
        nargs="+",
        default=None,
        metavar="RUN_FILE",
        help="build the table from these run files (.parquet or .partial.jsonl) instead of running cases",
    )


def execute(args: argparse.Namespace, console: Console) -> int:
    if args.records:
        try:
            frame = pd.concat([read_run(path) for path in args.records], ignore_index=True)
        except (OSError, ValueError) as exc:
            say(console, f"--records: {exc}", "error:", "red")
            return 2
        # The table names the commands that produced the runs, as the run files recorded them.
        commands = list(dict.fromkeys(frame["env_command"].dropna())) if "env_command" in frame else []
        write_table(frame, commands or ["(unknown)"], args.table, console)
        return 0
    config = config_from_args(args, console, writes=True)
    if config is None:
        return 2
    cases = calibration_cases(
        lengths=args.lengths or FIRST_SWEEP_LENGTHS,
        dtypes=args.dtypes,
        num_heads=args.heads,
        head_dim=args.head_dim,
        gate_regimes=args.gate_regimes,
        initial_states=args.initial_states,
        seed=args.seed or 0,
    )
    result = sweep(Run(config), cases, console, args.verbose)
    for label, text in grouped_failures(result.failures):
        say(console, text, label, "red")
    write_table(result.frame, [args.command_line], args.table, console)
    console.print(f"records: {result.paths['records']}")
    if result.interrupted:
        return INTERRUPTED
    return verdict_exit(result.frame["verdict"], config.strict)  # the table is written either way


def write_table(frame: pd.DataFrame, commands: list[str], table_path: Path | None, console: Console) -> None:
    table = calibration_table(frame)
    # Runs merged from several files may differ in commit and date: name every value.
    env = {
        k.removeprefix("env_"): ", ".join(str(v) for v in dict.fromkeys(frame[k].dropna()))
        for k in frame.columns
        if k.startswith("env_")
    }
    text = calibration_markdown(table, commands, env)
    console.print(text, highlight=False, soft_wrap=True)
    if table_path is not None:
        atomic_write_text(table_path, text)
        console.print(f"table: {table_path}")
