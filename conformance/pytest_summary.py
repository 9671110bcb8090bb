"""The pytest plugin's report at the end of a run: skips by reason, backends that cannot run here, why a
``-m`` selection is empty, the examples per test, the suite's own time, known issues and warnings, declared
working precisions, and the table of every measured error. ``conformance/pytest_plugin.py`` wires it in."""

from __future__ import annotations

import platform
import textwrap
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
import torch

from kda_cases.devices import gpu_arch
from kda_conformance.running.not_checked import ACCEPT_RESOURCE_VARIABLE, NOT_CHECKED_EXIT, accepts_resource
from kda_conformance.running.run import Run
from kda_conformance.running.stages import CLOCK
from kda_kernels import guard, registry
from kda_kernels.guard import BackendFault
from kda_reports.console import RECORD_LINE_HEADER, record_line, stale_lines
from kda_reports.findings import stale_known_issues
from kda_reports.precision import precision_lines

RUN = pytest.StashKey[Run]()
WRITTEN = pytest.StashKey[dict[str, Path]]()
# --kda-expected: the team's expected statuses, and the cells of this run that left theirs.
EXPECTED = pytest.StashKey[pd.DataFrame]()
DEPARTED = pytest.StashKey[list[str]]()


def _unavailable(run: Run) -> dict[str, str]:
    """The selected backends that cannot run on the run's device, with why (one that raised instead of
    answering says so)."""
    missing = {}
    for name in run.config.backends:
        try:
            available = guard.availability(registry.get(name), run.config.device)
        except BackendFault as fault:
            missing[name] = fault.reason
            continue
        if not available:
            missing[name] = available.reason
    return missing


def empty_selection(config: pytest.Config, exitstatus: int) -> bool:
    return bool(config.option.markexpr) and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED


def _selection_lines(config: pytest.Config) -> list[str]:
    """Why ``-m EXPR`` selected nothing: what it looked for, the device, each selected backend's markers and
    availability here (a backend's own markers, such as AITER's ``gfx950``, need its hardware)."""
    run_config = config.stash[RUN].config
    device = run_config.device
    arch = gpu_arch(device) if device.type == "cuda" else platform.machine()
    lines = [f"-m {config.option.markexpr!r} selected no test", f"device: {device} ({arch or 'unknown arch'})"]
    marker = "cpu" if device.type == "cpu" else ("rocm" if torch.version.hip else "cuda")
    for name in run_config.backends:
        backend = registry.get(name)
        markers = ", ".join((marker, *backend.markers(device)))
        available = backend.availability(device)
        runs_here = "runs here" if available else f"cannot run here: {available.reason}"
        lines.append(f"backend {name}: its tests are marked {markers}; {runs_here}")
    if run_config.strict:
        lines.append("--kda-strict: a selection that yields no test is an error (exit 4)")
    return lines


def skip_counts(reports: list) -> dict[str, int]:
    """How many tests skipped for each reason, most first (pytest's skip reports, any worker's)."""
    reasons: Counter[str] = Counter()
    for report in reports:
        longrepr = getattr(report, "longrepr", None)
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reasons[textwrap.shorten(str(reason).removeprefix("Skipped: "), 160, placeholder=" ...")] += 1
    return dict(reasons.most_common())


def not_checked(run: Run) -> int:
    """How many records of the run did not run for want of memory, where that is not accepted as a skip."""
    if accepts_resource():
        return 0
    rows = run.rows if run.frame is None else run.frame.to_dict("records")
    return sum(r["verdict"] == "resource" for r in rows)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    run = config.stash[RUN]
    written = config.stash.get(WRITTEN, {})
    tr = terminalreporter
    skips = skip_counts(tr.stats.get("skipped", []))
    if skips:
        tr.write_line(f"skipped {sum(skips.values())}, by reason: " + "; ".join(f"{n} {r}" for r, n in skips.items()))
    unavailable = _unavailable(run)
    if unavailable and len(unavailable) == len(run.config.backends):
        tr.section("KDA conformance: no selected backend can run here")
        for name, reason in unavailable.items():
            tr.write_line(f"{name}: {reason}")
        tr.write_line("every test of theirs skipped; --kda-strict (KDA_STRICT=1) makes that a failure")
    departed = config.stash.get(DEPARTED, [])
    if departed:
        tr.section("KDA conformance: left its expected status (--kda-expected)")
        for line in departed:
            tr.write_line(line)
    unjudged = not_checked(run)
    if unjudged:
        tr.section("KDA conformance: not checked")
        tr.write_line(
            f"{unjudged} record(s) did not run for want of memory (resource): a kernel never judged there is no "
            f"pass, so the session exits {NOT_CHECKED_EXIT} where nothing failed; {ACCEPT_RESOURCE_VARIABLE}=1 "
            "counts them as skips"
        )
    if empty_selection(config, exitstatus):
        tr.section("KDA conformance: why no test was selected")
        for line in _selection_lines(config):
            tr.write_line(line)
    if run.examples.entries:
        tr.section("KDA conformance: examples checked per test (and the first that failed)")
        for nodeid, entry in run.examples.entries.items():
            failed = "" if entry["failed_at"] is None else f", failed at example {entry['failed_at']}"
            tr.write_line(f"{nodeid}: {entry['examples']} examples{failed}")
        if "checks" in written:
            tr.write_line(f"checks: {written['checks']}")
    if any(CLOCK.calls.values()):
        tr.section("KDA conformance: the suite's own time by stage (all workers)")
        for line in CLOCK.lines():
            tr.write_line(line)
        if "timing" in written:
            tr.write_line(f"timing: {written['timing']}")
    rows = run.rows if run.frame is None else run.frame.to_dict("records")
    if not rows:
        return
    noted = Counter(
        (r["verdict"], r["backend"], r["check"], r["observed"])
        for r in rows
        if r["verdict"] in ("known", "warn", "marginal")
    )
    stale = stale_known_issues(pd.DataFrame(rows))
    if noted or not stale.empty:
        tr.section("KDA conformance: known issues, marginal failures and warnings (not failures of this run)")
        for (verdict, backend, check, observed), count in sorted(noted.items()):
            tr.write_line(f"{verdict}: {backend} {check} {observed}: {count} findings")
        for line in stale_lines(stale, run.config.strict):
            tr.write_line(line)
    declared = precision_lines(pd.DataFrame(rows))
    if declared:
        tr.section("KDA conformance: declared working precisions (their cost against the strict limits)")
        for line in declared:
            tr.write_line(line)
    tr.section("KDA conformance: max-abs error against the float64 reference")
    tr.write_line(RECORD_LINE_HEADER)
    for row in rows:
        tr.write_line(record_line(row))
    tr.write_line(f"report: {written['records']} and {written['summary_md']}")
