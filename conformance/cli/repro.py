"""``kda-conformance repro``: rerun one check on one case, say where it goes wrong, write a standalone test.

Every failure prints such a line: the budget check's through ``kda-conformance run --case``, every other
check's through this command with the parameters it drew (``--at`` a split point, ``--poison`` a mode).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from kda_conformance.checks import CHECKS, get_check, run_check
from kda_conformance.cli.common import (
    add_check_params,
    add_device,
    add_out,
    config_from_args,
    missing_params,
    parse_case,
    say,
    typed,
)
from kda_conformance.cli.exits import ERRORED, NOTHING_RAN, PASSED, verdict_exit
from kda_conformance.judging.judge import judge_for
from kda_conformance.repro.standalone import plan_lines, write_standalone
from kda_conformance.running.blame import fault_finding
from kda_conformance.running.faults import DeviceLost
from kda_conformance.running.run import Run
from kda_kernels import guard, registry
from kda_kernels.guard import BackendFault

DEFAULT_POISON = "nan"
# The findings said one by one, by verdict, with their label and style (a pass is summed up after them).
SHOWN_VERDICTS = {
    "fail": ("FAIL", "red"),
    "error": ("ERROR", "red"),
    "known": ("known", "yellow"),
    "skip": ("skip", "yellow"),
}
EXAMPLE = (
    "kda-conformance repro --device cpu --backend fla_recurrent --check poison --poison nan "
    """--case '{"seq_lens": [20, 0, 13], "packed": true}'"""
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--case",
        required=True,
        type=typed(parse_case),
        metavar="JSON_FILE_OR_ID",
        help="case JSON, a .json file, or a corpus id",
    )
    parser.add_argument("--backend", required=True, metavar="NAME", help="the registered backend to run")
    parser.add_argument(
        "--plugin", action="append", default=[], metavar="MODULE", help="module that registers backends"
    )
    add_device(parser)
    add_out(parser)
    parser.add_argument("--check", default="poison", choices=list(CHECKS), help="which check (default: poison)")
    add_check_params(parser)
    parser.add_argument(
        "--write-test",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write a standalone pytest file (served case, poisoned)",
    )


def execute(args: argparse.Namespace, console: Console) -> int:
    check = get_check(args.check)
    args.backends = [args.backend]
    config = config_from_args(args, console, writes=True)
    if config is None:
        return 2
    device, backend = config.device, registry.get(args.backend)
    params = {p.name: getattr(args, p.name) for p in check.params}
    if check.name == "poison" and params["poison"] is None:
        params["poison"] = DEFAULT_POISON
    if missing_params(check, params, console):
        return 2
    case = check.prepare(args.case, backend)
    judge = judge_for(check.name, case, backend.name, device, params)
    try:
        available = guard.availability(backend, device)
        supported = guard.supports(backend, case) if available else available
    except BackendFault as fault:  # its availability or supports raised: its error, recorded as the sweep does
        error = fault_finding(judge, fault)
        run = Run(config)
        run.record([error])
        run.finish()
        say(console, error.message(repro=False), "ERROR", "red")
        return ERRORED
    if not supported:
        say(console, f"{backend.name} does not run this case on {device}: {supported.reason}", "nothing ran:", "yellow")
        return NOTHING_RAN
    not_here = check.applies(backend, device.type)
    if not_here:  # as the pytest tests skip it (host_syncs on a CPU raised "Torch not compiled with CUDA")
        say(console, not_here, "nothing ran:", "yellow")
        return NOTHING_RAN
    shown = "".join(f", {name} {value}" for name, value in params.items())
    console.print(
        f"{case.id} ({case.label}) on {backend.name}, {device}, check {check.name}{shown}",
        highlight=False,
        soft_wrap=True,
    )
    if check.suite == "serving":
        for line in plan_lines(case, backend):
            console.print(line, highlight=False)
    run = Run(config)  # the sweep's executor: journal, quarantine, watchdog, memory retry, ledger
    try:
        findings = run_check(check, case, backend, device, params, run)
    except DeviceLost as lost:  # a sticky device error: recorded, and nothing more runs in this process
        findings = lost.findings
    run.record(findings)
    run.finish()
    for finding in findings:
        if finding.verdict in SHOWN_VERDICTS:
            label, style = SHOWN_VERDICTS[finding.verdict]
            say(console, finding.message(repro=False), label, style)
    code = verdict_exit((f.verdict for f in findings), config.strict)
    # A known issue does not fail the command, but the check did not pass: it failed as the ledger says.
    known = sorted({f.known_issue for f in findings if f.verdict == "known"})
    if code == PASSED and known:
        said = f"check {check.name} fails on this case as the ledger's {', '.join(known)} (not a new finding)"
        say(console, said, "known issue:", "yellow")
    elif code == PASSED:
        say(console, f"check {check.name} passes on this case", "no finding:", "green")
    elif code == NOTHING_RAN:
        say(console, f"check {check.name} did not run on this case (see the skip above)", "nothing ran:", "yellow")
    if args.write_test is not None:
        poison = args.poison or DEFAULT_POISON
        test, data = write_standalone(args.case, backend, device, poison, args.write_test, check.name)
        console.print(f"standalone test: {test} (data {data}); run it with: pytest {test}")
    return code
