"""``kda-conformance findings``: the findings ready for upstream (docs/findings.md) from a store's records and the
ledger of known issues, and a standalone test for each one that runs here (conformance/repro/upstream.py)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console

from kda_cases.devices import resolve_device
from kda_cases.files import atomic_write_text
from kda_conformance.cli.common import add_device, say
from kda_conformance.judging.known import LEDGER, load_ledger
from kda_conformance.repro.standalone_finding import issue_text
from kda_conformance.repro.triage import said_of_findings
from kda_conformance.repro.upstream import (
    FindingLostDevice,
    UpstreamFinding,
    committed_test_files,
    for_other_devices,
    upstream_findings,
    write_finding_test,
    write_findings_page,
)
from kda_conformance.running.config import RunConfig
from kda_conformance.running.run import Run
from kda_kernels import registry
from kda_kernels.registry import PluginError
from kda_reports.precision import precision_lines
from kda_reports.store import Store, load_store

EXAMPLE = "kda-conformance findings --store nightly-store --write-tests findings --device cuda"
# A finding's issue text for upstream: kda-conformance findings --store nightly-store --report <id>
PAGE = "findings.md"
# The repository's committed standalone files (a checkout's; an installed package has none).
COMMITTED_TESTS = Path(__file__).resolve().parents[2] / "findings"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", type=Path, required=True, metavar="DIR", help="the store (or run folder) to read")
    parser.add_argument(
        "--out", type=Path, default=None, metavar="DIR", help="the folder the page is written to (default: the store)"
    )
    parser.add_argument(
        "--page", type=Path, default=None, metavar="FILE", help=f"the page to write (default: OUT/{PAGE})"
    )
    parser.add_argument("--ledger", type=Path, default=LEDGER, metavar="FILE", help="the ledger of known issues")
    parser.add_argument(
        "--write-tests",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write a standalone test (torch, the kernel's package and pytest; nothing of this suite) for each "
        "open or new finding, one per library whose backend measured it and gives a standalone call "
        "(test_<id>_<library>.py), and run it once where its backend runs here",
    )
    parser.add_argument(
        "--report",
        default=None,
        metavar="ID",
        help="print the finding ID as an upstream issue (title, what goes wrong, environment, repro, expected "
        "against actual, suspected cause, related upstream issues and fixes) instead of writing the page",
    )
    parser.add_argument(
        "--plugin", action="append", default=[], metavar="MODULE", help="module that registers backends"
    )
    parser.add_argument(
        "--triage",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="a triage.json of `kda-conformance triage` over this store (repeatable): the page shows each new "
        "finding's cause as triage found it, or 'not triaged'",
    )
    parser.add_argument(
        "--issue",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write the body of one tracking issue for the store's new findings (each as --report gives it) "
        "to FILE, and nothing where there is none: a nightly's merge job posts it (docs/ci.md)",
    )
    parser.add_argument(
        "--sanitize",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="a sanitize.json of `kda-conformance sanitize` over this store (repeatable): the page shows what "
        "compute-sanitizer reported on each finding's smallest case",
    )
    add_device(parser)


def store_findings(args: argparse.Namespace, console: Console) -> tuple[Store, list[UpstreamFinding]] | None:
    """The store ``--store`` names and its findings under ``--ledger`` (``--plugin`` loaded first); None, said,
    where one cannot be read or holds no records."""
    try:
        for module in args.plugin:
            registry.load_plugin(module)
        ledger = load_ledger(args.ledger)
        store = load_store(args.store)
    except (OSError, ValueError, PluginError) as exc:
        say(console, str(exc), "error:", "red")
        return None
    if store.records.empty:
        say(console, f"--store {args.store} holds no records", "error:", "red")
        return None
    return store, upstream_findings(store.records, ledger)


def execute(args: argparse.Namespace, console: Console) -> int:
    read = store_findings(args, console)
    if read is None:
        return 2
    store, findings = read
    try:
        causes = said_of_findings(args.triage, "cause")
    except (OSError, ValueError) as exc:
        say(console, f"--triage: {exc}", "error:", "red")
        return 2
    try:
        sanitized = said_of_findings(args.sanitize, "summary")
    except (OSError, ValueError, KeyError) as exc:
        say(console, f"--sanitize: {exc}", "error:", "red")
        return 2
    findings = [
        replace(
            f, cause=_cause(f, causes), sanitizer=sanitized.get(f.id) or sanitized.get(f"{f.case_id} {f.check}", "")
        )
        for f in findings
    ]
    if args.report is not None:
        chosen = [f for f in findings if f.id == args.report]
        if not chosen:
            say(console, f"--report {args.report}: no such finding; the store's: {', '.join(f.id for f in findings)}",
                "error:", "red")  # fmt: skip
            return 2
        console.print(issue_text(with_committed_test(chosen[0])), markup=False, highlight=False, soft_wrap=True)
        return 0
    if args.write_tests is not None:
        try:
            device = resolve_device(args.device)
        except ValueError as exc:
            say(console, str(exc), "error:", "red")
            return 2
        args.write_tests.mkdir(parents=True, exist_ok=True)
        # Each finding's check is rerun through the executor; its records go beside the tests, not the store.
        run = Run(RunConfig(device=device, backends=(), out=args.write_tests, command=args.command_line))
        findings = _write_tests(findings, device, args.write_tests, run)
        run.finish()
    else:
        findings = [with_committed_test(f) for f in findings]
    # Every device of every run: the shards of one night may run on different machines.
    runs = store.records.drop_duplicates(["run_id", "env_device_type", "env_device_name"])
    where = ", ".join(sorted({f"{r.env_device_type} {r.env_device_name}" for r in runs.itertuples()}))
    source = f"runs {', '.join(sorted(runs['run_id'].astype(str).unique()))} ({where})"
    folder = args.out or (args.store if args.store.is_dir() else args.store.parent)
    page_path = args.page or folder / PAGE
    page_path.parent.mkdir(parents=True, exist_ok=True)
    hidden = for_other_devices(findings, store.records)
    elsewhere = ""
    if hidden:
        devices = ", ".join(sorted({f.device for f in hidden}))
        elsewhere = f"{len(hidden)} ledger entries for {devices}, where no run of the store ran, not listed"
        findings = [f for f in findings if f.id not in {h.id for h in hidden}]
    page = write_findings_page(findings, source, page_path, precision_lines(store.records), elsewhere)
    if args.issue is not None:
        _write_issue(args.issue, [f for f in findings if f.status == "new"], source, page_path)
    for f in findings:
        console.print(f"{f.status:8} {f.id}: {f.backends}; {f.worst}; {f.test or ''}", highlight=False, soft_wrap=True)
    if elsewhere:
        console.print(elsewhere, highlight=False)
    console.print(f"page: {page}", highlight=False)
    return 0


def _write_issue(path: Path, new: list[UpstreamFinding], source: str, page: Path) -> None:
    """The tracking issue's body: every new finding as an upstream issue's text, under one heading; an empty
    file where there is none (a CI step posts only a file that holds something)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not new:
        atomic_write_text(path, "")
        return
    head = [f"{len(new)} new finding{'s' * (len(new) != 1)} in {source} (the whole page: {page.name})", ""]
    body = "\n\n---\n\n".join(issue_text(f) for f in new)
    atomic_write_text(path, "\n".join(head) + "\n" + body + "\n")


def _cause(finding: UpstreamFinding, causes: dict[str, str]) -> str:
    said = causes.get(finding.id) or causes.get(f"{finding.case_id} {finding.check}")
    return said or ("not triaged" if finding.status == "new" else "")


def with_committed_test(finding: UpstreamFinding, folder: Path = COMMITTED_TESTS) -> UpstreamFinding:
    """An open finding whose standalone file is in the repository's findings/ (written and run on a GPU by
    ``--write-tests``, then committed) names it, where this generation wrote none."""
    paths = committed_test_files(finding.id, folder)
    if finding.test or finding.status not in ("open", "new") or not paths:
        return finding
    return replace(finding, test=", ".join(f"findings/{path.name}" for path in paths) + " (in the repository)")


def _write_tests(
    findings: list[UpstreamFinding], device: torch.device, folder: Path, run: Run
) -> list[UpstreamFinding]:
    """Each finding's test, the crashes' last: a rerun that leaves a sticky device error ends what this
    process may run on the device (its own file is written and run first, in a process of its own), so the
    findings after it say so instead of failing in a dead context."""
    written: dict[str, UpstreamFinding] = {}
    lost = ""
    for finding in sorted(findings, key=lambda f: f.worst.startswith("error")):
        if lost:
            written[finding.id] = replace(finding, test=f"not written: the device was lost in {lost}'s rerun")
            continue
        try:
            written[finding.id] = write_finding_test(finding, device, folder, run)
        except FindingLostDevice as exc:  # its file was written and run; the suite's rerun then lost the device
            lost = finding.id
            written[finding.id] = exc.finding
    return [written[f.id] for f in findings]
