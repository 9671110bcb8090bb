"""The sanitizer lane (``kda-conformance sanitize``): a finding's smallest case, or a sample of a backend's
cases, rerun under NVIDIA's ``compute-sanitizer`` (memcheck: reads and writes out of bounds or misaligned, and
the device's exceptions; initcheck: reads of device memory nobody wrote; racecheck: shared-memory races), and
what the tool said, read back: each error's kind, the kernel, the thread and block, the address.

A crash record says "an illegal memory access" or "misaligned address" and nothing of where; the tool names
the kernel and the access, which is what a maintainer needs to act. The tool instruments every launch, so a
rerun is slow (a compile is as before, each kernel runs tens of times slower): each has a time limit, and a
rerun past it is recorded as stopped. Every process the rerun starts is followed (``--target-processes all``:
the repro's isolated worker runs the kernel).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kda_conformance.repro.triage import launch, parse_repro

TOOLS = ("memcheck", "initcheck", "racecheck", "synccheck")
DEFAULT_TOOLS = ("memcheck", "initcheck")
# How many errors the tool prints per process: the first ones name the kernel; thousands of threads of one
# kernel repeat them.
PRINT_LIMIT = 20
_PREFIX = "========="
# "at 0x160 in memcheck_demo.cu:6:unaligned_kernel()" (older tools) or "at unaligned_kernel()+0x160 in
# memcheck_demo.cu:6" (newer ones); a Triton kernel has no file.
_AT_OLD = re.compile(r"^at 0x[0-9a-fA-F]+ in (?:\S+:\d+:)?(?P<kernel>[^\s(]+)")
_AT_NEW = re.compile(r"^at (?P<kernel>[^\s(+]+)(?:\([^)]*\))?\+0x[0-9a-fA-F]+")
_THREAD = re.compile(r"by thread \((?P<thread>[\d, ]+)\) in block \((?P<block>[\d, ]+)\)")
_SUMMARY = re.compile(r"ERROR SUMMARY: (?P<count>\d+) errors?")
_RACE = re.compile(r"(?P<kind>\w+) access at (?P<at>.+?) in (?:\S+:\d+:)?(?P<kernel>[^\s(]+)")


def find_sanitizer(env: dict[str, str] | None = None) -> str | None:
    """The compute-sanitizer to run: on ``PATH``, else in the CUDA toolkit (``CUDA_HOME``, ``/usr/local/cuda``)."""
    env = dict(os.environ if env is None else env)
    found = shutil.which("compute-sanitizer", path=env.get("PATH"))
    if found:
        return found
    for home in (env.get("CUDA_HOME", ""), env.get("CUDA_PATH", ""), "/usr/local/cuda"):
        candidate = Path(home, "bin", "compute-sanitizer") if home else None
        if candidate is not None and candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


@dataclass(frozen=True)
class SanitizerError:
    """One error the tool reported: its kind (its first line), where (kernel, thread, block) and the rest."""

    kind: str
    kernel: str = ""
    thread: str = ""
    block: str = ""
    address: str = ""
    detail: tuple[str, ...] = ()

    def line(self) -> str:
        where = f" in {self.kernel}" if self.kernel else ""
        who = f", thread ({self.thread}) block ({self.block})" if self.thread else ""
        return f"{self.kind}{where}{who}" + (f"; {self.address}" if self.address else "")


@dataclass(frozen=True)
class SanitizerReport:
    """What one tool said of one process: its errors (the first ``PRINT_LIMIT``), the count its summary gives,
    and the CUDA API errors it saw (a launch that failed, the error the program then hit)."""

    errors: tuple[SanitizerError, ...] = ()
    count: int | None = None
    api_errors: tuple[str, ...] = ()

    def summary(self) -> str:
        if self.errors:
            first = self.errors[0].line()
            more = (self.count or len(self.errors)) - 1
            return first + (f" (and {more} more)" if more > 0 else "")
        if self.api_errors:
            return self.api_errors[0]
        return "no error" if self.count == 0 else "no report"


def parse_report(text: str) -> SanitizerReport:
    """A compute-sanitizer log read back. Each error is a line after the prefix (``========= Invalid __global__
    read of size 4 bytes``) followed by indented lines (``=========     at ...``, ``by thread ... in block ...``,
    ``Address ...``); "Program hit ..." lines are the API errors; "ERROR SUMMARY: N errors" the count."""
    errors: list[SanitizerError] = []
    api: list[str] = []
    count = None
    current: dict | None = None

    def close() -> None:
        if current is not None:
            errors.append(SanitizerError(**{**current, "detail": tuple(current["detail"])}))

    for raw in text.splitlines():
        if not raw.startswith(_PREFIX):
            continue
        body = raw[len(_PREFIX) :]
        stripped = body.strip()
        if not stripped or stripped == "COMPUTE-SANITIZER":
            continue
        summary = _SUMMARY.search(stripped)
        if summary:
            close()
            current, count = None, int(summary.group("count"))
            continue
        if not body.startswith("  "):  # a new entry: an error, or an API error
            close()
            current = None
            if stripped.startswith("Program hit"):
                api.append(stripped)
            elif not stripped.startswith(("Saved host backtrace", "Leaked")):
                current = {"kind": stripped, "kernel": "", "thread": "", "block": "", "address": "", "detail": []}
                race = _RACE.search(stripped)
                if race:
                    current["kernel"] = race.group("kernel")
            continue
        if current is None:
            continue
        at = _AT_OLD.match(stripped) or _AT_NEW.match(stripped)
        thread = _THREAD.search(stripped)
        if at and not current["kernel"]:
            current["kernel"] = at.group("kernel")
        elif thread and not current["thread"]:
            current["thread"], current["block"] = thread.group("thread"), thread.group("block")
        elif stripped.startswith("Address") and not current["address"]:
            current["address"] = stripped
        elif not stripped.startswith(("Saved host backtrace", "#", "Host Frame")) and len(current["detail"]) < 4:
            current["detail"].append(stripped)
    close()
    return SanitizerReport(tuple(errors[:PRINT_LIMIT]), count, tuple(dict.fromkeys(api)))


@dataclass(frozen=True)
class SanitizerRun:
    """One tool over one rerun: the command, its exit (None: stopped after ``timed_out`` seconds), and the
    report of each process the tool followed that said something."""

    tool: str
    command: str
    exit: int | None
    timed_out: float | None = None
    reports: tuple[SanitizerReport, ...] = ()

    @property
    def outcome(self) -> str:
        if self.timed_out is not None:
            return f"stopped after {self.timed_out:g} s"
        errors = [r for r in self.reports if r.errors or r.api_errors]
        if errors:
            return "; ".join(r.summary() for r in errors[:2])
        return "no error" if self.reports else f"no report (exit {self.exit})"


@dataclass(frozen=True)
class Sanitized:
    finding: str
    backend: str
    check: str
    case_id: str
    runs: tuple[SanitizerRun, ...] = field(default_factory=tuple)

    def summary(self) -> str:
        return "; ".join(f"{r.tool}: {r.outcome}" for r in self.runs)


def sanitize(
    finding_id: str,
    repro: str,
    parser: argparse.ArgumentParser,
    out: Path,
    sanitizer: str,
    tools: Sequence[str] = DEFAULT_TOOLS,
    env: dict[str, str] | None = None,
    plugins: Sequence[str] = (),
    timeout: float | None = None,
) -> Sanitized:
    """Rerun one finding's case (its repro line) under each of ``tools``, one process each; the tool's logs go to
    ``out`` (one per process, ``<finding>-<tool>-<pid>.log``) and are read back."""
    env = dict(os.environ if env is None else env)
    r = parse_repro(repro, parser, plugins)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for tool in tools:
        stem = f"{finding_id}-{tool}"
        for old in glob.glob(str(out / f"{glob.escape(stem)}-*.log")):
            Path(old).unlink()
        prefix = [sanitizer, "--tool", tool, "--target-processes", "all", "--print-limit", str(PRINT_LIMIT)]
        prefix += ["--log-file", str(out / f"{stem}-%p.log")]
        command, exit = launch(r, out, env, timeout, prefix=prefix)
        logs = sorted(glob.glob(str(out / f"{glob.escape(stem)}-*.log")))
        reports = tuple(parse_report(Path(log).read_text(errors="replace")) for log in logs)
        runs.append(SanitizerRun(tool, command, exit, timeout if exit is None else None, reports))
    return Sanitized(finding_id, r.backend, r.check, r.case.id, tuple(runs))


def sanitize_json(results: list[Sanitized]) -> str:
    return json.dumps([{**asdict(s), "summary": s.summary()} for s in results], indent=1) + "\n"


def sanitize_markdown(results: list[Sanitized], source: str, sanitizer: str) -> str:
    lines = [
        "# Sanitizer",
        "",
        f"`kda-conformance sanitize` over {source}: each finding's smallest case rerun under `{sanitizer}`, one "
        "tool at a time (conformance/repro/sanitize.py); what each tool reported, read back from its logs beside "
        "this page. Every command is in sanitize.json.",
        "",
        "| finding | backend | check | case | tool | what the tool reported |",
        "|---|---|---|---|---|---|",
    ]
    for s in results:
        for r in s.runs:
            cells = [s.finding, s.backend, s.check, s.case_id, r.tool, r.outcome]
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"
