"""``kda-conformance``: the suite outside pytest."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kda_conformance.sweep import (
    Outcome,
    first_sweep_cases,
    outcome_records,
    parse_dtypes,
    parse_lengths,
    resolve_device,
    run_cases,
)
from kda_kernels import registry
from kda_reports.environment import environment
from kda_reports.runfile import DEFAULT_OUT, record_run


def _arg(parse):  # type: ignore[no-untyped-def]
    def convert(text: str):  # type: ignore[no-untyped-def]
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kda-conformance", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the conformance sweep and write a report")
    run.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: ./out)")
    run.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    run.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE, which registers more backends (repeatable)",
    )
    run.add_argument(
        "--backend",
        action="append",
        dest="backends",
        metavar="NAME",
        help="backend to test, repeatable (default: fla_chunk and fla_recurrent)",
    )
    run.add_argument("--lengths", type=_arg(parse_lengths), default=None, help="sequence lengths, e.g. 37,64,65,130")
    run.add_argument("--dtypes", type=_arg(parse_dtypes), default=["bf16", "fp32"], help="input dtypes, e.g. bf16,fp32")
    run.add_argument("--heads", type=int, default=2, help="query/key heads (= value heads) per case")
    run.add_argument("--head-dim", type=int, default=64, help="K = V head dimension")
    run.add_argument("--seed", type=int, default=0)
    return parser


def _summary_table(frame: pd.DataFrame) -> Table:
    table = Table(title="KDA conformance: max-abs error against the float64 reference")
    for col in ("case", "backend", "tensor", "verdict", "max-abs", "budget", "rel-RMS", "s"):
        table.add_column(col, justify="right" if col in ("max-abs", "budget", "rel-RMS", "s") else "left")
    colors = {"pass": "green", "fail": "red", "error": "red", "skip": "yellow"}
    for row in frame.itertuples():

        def fmt(x: float) -> str:
            return "" if pd.isna(x) else f"{x:.2e}"

        verdict = f"[{colors.get(row.verdict, 'white')}]{row.verdict}[/]"
        table.add_row(
            f"{row.case_id}\n{row.label}",
            row.backend,
            row.tensor or "-",
            verdict,
            fmt(getattr(row, "max_abs", float("nan"))),
            fmt(getattr(row, "budget", float("nan"))),
            fmt(getattr(row, "rel_rms", float("nan"))),
            f"{row.seconds:.2f}",
        )
    return table


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    try:
        device = resolve_device(args.device)
        for module in args.plugin:
            registry.load_plugin(module)
        names = args.backends or ["fla_chunk", "fla_recurrent"]
        backends = [registry.get(name) for name in names]
    except (ValueError, KeyError, registry.PluginError) as exc:
        console.print(f"[red]error:[/] {exc.args[0]}")
        return 2
    cases = first_sweep_cases(
        lengths=args.lengths or (37, 64, 65, 130),
        dtypes=args.dtypes,
        num_heads=args.heads,
        head_dim=args.head_dim,
        seed=args.seed,
    )
    rows: list[dict] = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("sweep", total=len(cases) * len(backends))

        def record(outcome: Outcome) -> None:
            rows.extend(outcome_records(outcome, device))
            progress.update(task, advance=1, description=f"{outcome.backend} {outcome.case.label}")

        run_cases(cases, backends, device, on_outcome=record)
    frame, paths = record_run(rows, environment(device), args.out)
    run_id = frame["run_id"].iloc[0]
    console.print(_summary_table(frame))
    for row in frame[frame["verdict"].isin(["error", "skip"])].itertuples():
        console.print(f"[yellow]{row.verdict}[/] {row.backend} {row.case_id} ({row.label}): {row.reason}")
    for row in frame[frame["verdict"] == "fail"].itertuples():
        console.print(
            f"[red]fail[/] {row.backend} {row.case_id} ({row.label}) {row.tensor}: max_abs {row.max_abs:.3e} > "
            f"budget {row.budget:.1e}, first bad: {row.first_bad or '-'}, non-finite: {row.nonfinite}"
        )
    counts = frame["verdict"].value_counts().to_dict()
    console.print(f"run {run_id}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    console.print(f"records: {paths['records']}\nsummary: {paths['summary_md']}")
    return 1 if counts.get("fail") or counts.get("error") else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    if args.command == "run":
        return cmd_run(args, console)
    return 2  # pragma: no cover - argparse enforces the subcommand


if __name__ == "__main__":
    sys.exit(main())
