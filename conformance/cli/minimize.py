"""``kda-conformance minimize``: a smaller case that fails the same check the same way, within a time budget
(conformance/repro/minimize.py), with its repro line and, on request, a standalone test."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from rich.console import Console

from kda_cases.case import Case
from kda_conformance.checks import CHECKS, get_check
from kda_conformance.cli.common import (
    add_check_params,
    add_device,
    add_out,
    check_params,
    config_from_args,
    missing_params,
    parse_case,
    say,
    typed,
)
from kda_conformance.cli.exits import ERRORED, PASSED, verdict_exit
from kda_conformance.judging.repro import BUDGET_CHECK, repro_line
from kda_conformance.repro.minimize import minimize
from kda_conformance.repro.standalone import write_standalone
from kda_conformance.running.faults import DeviceLost
from kda_conformance.running.run import Run
from kda_kernels import registry
from kda_kernels.registry import plugin_module
from kda_reports.findings import FAILED
from kda_reports.runfile import read_run

EXAMPLE = "kda-conformance minimize --from-run out/runs/RUN_ID.parquet --budget-s 120"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--case", type=typed(parse_case), metavar="JSON_FILE_OR_ID", help="the failing case: JSON, a file or an id"
    )
    source.add_argument(
        "--from-run",
        type=Path,
        metavar="RUN_FILE",
        help="a run's records (.parquet or .partial.jsonl): its first failure (case, backend, check, parameters)",
    )
    parser.add_argument("--backend", metavar="NAME", help="the backend (with --case; --from-run names its own)")
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="module that registers backends (repeatable); the plugins a run file's repro line names are loaded "
        "only when given here",
    )
    add_device(parser)
    add_out(parser)
    parser.add_argument(
        "--check", default=BUDGET_CHECK, choices=list(CHECKS), help=f"which check (default: {BUDGET_CHECK})"
    )
    add_check_params(parser)
    parser.add_argument(
        "--budget-s", type=float, default=300.0, metavar="S", help="time the search may take (default: 300 s)"
    )
    parser.add_argument(
        "--write-test", type=Path, default=None, metavar="FILE", help="also write the minimal case's standalone test"
    )


def _first_failure(path: Path) -> tuple[Case, str, str, dict[str, str], list[str]]:
    """Case, backend, check, the check's parameters and the plugins (read back from the repro line) of a
    run's first failed record."""
    records = read_run(path)
    failed = records[records["verdict"].isin(FAILED)]
    if failed.empty:
        raise ValueError(f"{path.name} holds no failure")
    row = failed.iloc[0]
    words = shlex.split(str(row.get("repro") or ""))
    names = check_params()
    params = {w[2:]: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--") and w[2:] in names}
    plugins = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--plugin"]
    check = str(row.get("check") or BUDGET_CHECK)
    return Case.from_json(row["case_json"]), str(row["backend"]), check, params, plugins


def execute(args: argparse.Namespace, console: Console) -> int:
    if args.from_run is not None:
        try:
            case, backend_name, check_name, given, plugins = _first_failure(args.from_run)
        except (OSError, ValueError) as exc:
            say(console, f"--from-run: {exc}", "error:", "red")
            return 2
        named = {plugin_module(p) for p in args.plugin}
        missing = [p for p in plugins if plugin_module(p) not in named]
        if missing:  # a run file is data: the modules it names are never imported on its say-so
            loads = " ".join(f"--plugin {shlex.quote(p)}" for p in missing)
            say(console, f"--from-run: its failure's repro line loads {loads}; pass that to minimize it", "error:")
            return 2
        check = get_check(check_name)
        params = {p.name: p.parse(given[p.name]) if p.name in given else None for p in check.params}
    else:
        if not args.backend:
            say(console, "--case needs --backend NAME", "error:", "red")
            return 2
        case, backend_name, check = args.case, args.backend, get_check(args.check)
        params = {p.name: getattr(args, p.name) for p in check.params}
    if missing_params(check, params, console):
        return 2
    args.backends = [backend_name]
    config = config_from_args(args, console, writes=True)
    if config is None:
        return 2
    device, backend = config.device, registry.get(backend_name)
    console.print(f"minimizing {case.id} ({case.label}) on {backend.name}, check {check.name}", highlight=False)
    run = Run(config)  # every candidate through the run's executor; the original and the minimal case recorded
    try:
        result = minimize(
            check,
            check.prepare(case, backend),
            backend,
            device,
            params,
            args.budget_s,
            progress=lambda line: console.print(f"  {line}", highlight=False),
            run=run,
        )
    except DeviceLost as lost:  # a sticky device error: nothing more may run in this process
        run.record(lost.findings)
        say(console, f"{lost}", "stopped:", "red")
        run.finish(complete=False)
        return ERRORED
    run.record(result.original_findings)
    if result.case != result.original:
        run.record(result.findings)
    records = run.finish().get("records")
    if records:
        console.print(f"records: {records}", highlight=False)
    code = verdict_exit((f.verdict for f in result.findings), config.strict)
    if result.failure is None:
        for finding in result.findings:
            if finding.verdict == "skip":
                say(console, finding.message(repro=False), "skip", "yellow")
        what = "passes" if code == PASSED else "did not run"
        say(console, f"{case.id} {what} check {check.name} on {backend.name}: nothing to minimize", "no failure:")
        return code
    small = result.case
    how = "the time budget ran out" if result.stopped_by_budget else "no smaller case fails the same way"
    console.print(
        f"minimal case after {result.tried} tries in {result.seconds:.0f} s ({how}): {small.id} ({small.label}); "
        f"{result.original.total_tokens} -> {small.total_tokens} tokens, {result.original.num_seqs} -> "
        f"{small.num_seqs} sequences, heads {result.original.num_heads}/{result.original.num_v_heads} -> "
        f"{small.num_heads}/{small.num_v_heads}, K x V {result.original.head_k_dim}x{result.original.head_v_dim} "
        f"-> {small.head_k_dim}x{small.head_v_dim}; still {result.failure[1]} {result.failure[0]}".rstrip(),
        highlight=False,
    )
    console.print(f"case: {small.to_json()}", highlight=False, markup=False)
    console.print(f"repro: {repro_line(check.name, small, backend.name, device, params)}", highlight=False)
    if args.write_test is not None:
        poison = str(params.get("poison") or "nan")
        test, data = write_standalone(small, backend, device, poison, args.write_test, check.name)
        console.print(f"standalone test: {test} (data {data}); run it with: pytest {test}")
    return code  # the minimal case's verdict: 1 when it fails, 3 when it raises
