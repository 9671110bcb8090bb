"""``kda-conformance sanitize``: rerun each finding's smallest case (and a sample of each backend's passing cases)
under NVIDIA's compute-sanitizer and record what it reports: the kernel, the access, the thread
(conformance/repro/sanitize.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
from rich.console import Console

from kda_cases.case import Case
from kda_cases.files import atomic_write_text
from kda_conformance.cli.common import say
from kda_conformance.cli.exits import NOTHING_RAN
from kda_conformance.cli.findings import store_findings
from kda_conformance.cli.triage import add_rerun_arguments, plugins_missing, rerun_setup
from kda_conformance.judging.repro import BUDGET_CHECK, repro_line
from kda_conformance.repro.sanitize import (
    DEFAULT_TOOLS,
    TOOLS,
    find_sanitizer,
    sanitize,
    sanitize_json,
    sanitize_markdown,
)
from kda_conformance.repro.upstream import NOT_A_KERNEL
from kda_conformance.running.option_values import parse_count
from kda_conformance.running.options import typed

EXAMPLE = "kda-conformance sanitize --store nightly-store --rerun-timeout 900"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_rerun_arguments(parser, "sanitize", "every open and new one, crashes first")
    parser.add_argument(
        "--tool",
        action="append",
        default=[],
        choices=TOOLS,
        help=f"a compute-sanitizer tool (repeatable; default: {', '.join(DEFAULT_TOOLS)})",
    )
    parser.add_argument(
        "--sample",
        type=typed(lambda text: parse_count("--sample", text, lowest=0)),
        default=0,
        metavar="N",
        help="also rerun the N smallest cases of each backend that passed their budget check (default 0): a read "
        "of memory nobody wrote need not change a result",
    )
    parser.add_argument(
        "--sanitizer",
        default=None,
        metavar="PATH",
        help="the compute-sanitizer to run (default: on PATH, else CUDA_HOME/bin or /usr/local/cuda/bin)",
    )


def _sample(records: pd.DataFrame, per_backend: int) -> list[tuple[str, str]]:
    """(id, repro line) of the ``per_backend`` smallest cases each backend passed its budget check on."""
    if per_backend == 0:
        return []
    budget = records[(records["check"] == BUDGET_CHECK) & ~records["backend"].astype(str).isin(NOT_A_KERNEL)]
    every_tensor_passed = budget.groupby(["backend", "case_id"])["verdict"].transform(lambda v: (v == "pass").all())
    passed = budget[every_tensor_passed.astype(bool)].drop_duplicates(["backend", "case_id"])
    chosen = []
    for backend, rows in passed.groupby("backend", sort=True):
        cases = sorted((Case.from_json(str(j)) for j in rows["case_json"]), key=lambda c: (c.total_tokens, c.id))
        device = str(rows["device"].iloc[0]) if "device" in rows else "cuda"
        for case in cases[:per_backend]:
            chosen.append((f"sample-{backend}-{case.id}", repro_line(BUDGET_CHECK, case, str(backend), device, {})))
    return chosen


def execute(args: argparse.Namespace, console: Console) -> int:
    from kda_conformance.cli import build_parser

    read = store_findings(args, console)
    if read is None:
        return 2
    store, findings = read
    unknown = sorted(set(args.finding) - {f.id for f in findings})
    if unknown:
        say(console, f"--finding {', '.join(unknown)}: no such finding in the store", "error:", "red")
        return 2
    sanitizer = args.sanitizer or find_sanitizer()
    if sanitizer is None:
        say(console, "compute-sanitizer is not on PATH, in CUDA_HOME/bin or /usr/local/cuda/bin (it ships with the "
            "CUDA toolkit); pass --sanitizer PATH", "nothing ran:", "yellow")  # fmt: skip
        return NOTHING_RAN
    chosen = [f for f in findings if (f.id in args.finding if args.finding else f.status in ("open", "new"))]
    # Crashes first (what the tool names best), then the smallest cases.
    chosen.sort(
        key=lambda f: (
            not f.worst.startswith("error"),
            Case.from_json(f.case_json).total_tokens if f.case_json else float("inf"),
        )
    )
    lines = [(f.id, f.repro) for f in chosen if f.repro] + _sample(store.records, args.sample)
    setup = rerun_setup(args, store.records, "sanitize", console)
    if setup is None:
        return 2
    out, env, runs = setup
    parser, results = build_parser(), []
    tools = tuple(dict.fromkeys(args.tool)) or DEFAULT_TOOLS
    for finding_id, repro in lines:
        if plugins_missing(finding_id, repro, args.plugin, parser, console):
            continue
        console.print(f"sanitize {finding_id}: {', '.join(tools)}", highlight=False)
        result = sanitize(
            finding_id, repro, parser, out, sanitizer, tools, env=env, plugins=args.plugin, timeout=args.rerun_timeout
        )
        results.append(result)
        console.print(f"  {result.summary()}", highlight=False, soft_wrap=True)
        _save(out, results, runs, sanitizer)
    if not results:
        _save(out, results, runs, sanitizer)
    console.print(f"sanitize: {out / 'sanitize.md'} ({len(results)} reruns)", highlight=False)
    return 0


def _save(out: Path, results: list, runs: str, sanitizer: str) -> None:
    atomic_write_text(out / "sanitize.md", sanitize_markdown(results, f"runs {runs}", sanitizer))
    atomic_write_text(out / "sanitize.json", sanitize_json(results))
