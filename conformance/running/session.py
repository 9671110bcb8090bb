"""One run as it goes: its configuration, the truth of its recent cases, its records, its example log.

The command line and the pytest plugin each hold one :class:`Run`; checks ask it for a case's truth and
hand it their findings, and it writes the run's files when it finishes.
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pandas as pd

from kda_cases.case import Case
from kda_conformance.judging.judge import judge_for
from kda_conformance.judging.known import apply_known
from kda_conformance.judging.tolerance import InvalidTruth
from kda_conformance.running.config import RunConfig
from kda_conformance.running.faults import DeviceLost, is_out_of_memory, is_sticky, memory_report
from kda_conformance.running.memory import device_slot, release_cached_memory
from kda_conformance.running.runner import raised_at
from kda_conformance.running.search import ExampleLog
from kda_conformance.running.stages import CLOCK
from kda_conformance.running.truth import CaseTruth, case_truth
from kda_kernels.protocol import Backend
from kda_reports.findings import SUITE_BACKEND, Finding
from kda_reports.runfile import RunRecorder, atomic_write, merge_parts, run_stem
from kda_reports.schema import record_rows

# Long GPU cases hold gigabytes of truth; a handful is enough for every backend to reuse a case.
TRUTH_CACHE_SIZE = 4


class Run:
    """A run's state: created by a front end from its :class:`RunConfig`."""

    def __init__(self, config: RunConfig, worker: str | None = None) -> None:
        self.config = config
        # A pytest-xdist worker writes a part of the run of its own; the controller merges the parts.
        self.worker = worker
        self.examples = ExampleLog()
        self._truths: OrderedDict[str, CaseTruth] = OrderedDict()
        self._recorder: RunRecorder | None = None
        self.frame: pd.DataFrame | None = None  # the records as written, once the run finished

    @property
    def recorder(self) -> RunRecorder:
        """The run's recorder, made at its first record (it names the run and starts its journal)."""
        if self._recorder is None:
            config = self.config
            self._recorder = RunRecorder(config.environment(), config.out, config.run_id, self.part)
        return self._recorder

    @property
    def part(self) -> str | None:
        """The part of the run this process writes: the host's shard and the worker, where there are."""
        if self.worker is None:
            return self.config.part
        return f"{self.config.part}-{self.worker}" if self.config.part else self.worker

    @property
    def rows(self) -> list[dict]:
        return [] if self._recorder is None else self._recorder.rows

    def truth(self, case: Case) -> CaseTruth:
        """Inputs, float64 truth and budgets of ``case``, kept for the last few cases (each backend reuses them)."""
        if case.id not in self._truths:
            self._truths[case.id] = case_truth(case, self.config.device)
            while len(self._truths) > TRUTH_CACHE_SIZE:
                self._truths.popitem(last=False)
        self._truths.move_to_end(case.id)
        return self._truths[case.id]

    def checked(
        self,
        check: str,
        case: Case,
        backend: Backend,
        params: Mapping[str, object],
        run: Callable[[CaseTruth], list[Finding]],
    ) -> list[Finding]:
        """``run(truth)`` of ``check`` on ``case``, holding the device (alone for a large case). A case that
        runs out of memory is retried once alone; one that still does not fit is a ``resource`` finding,
        never the kernel's verdict. A sticky device error raises DeviceLost with the finding that charges
        it to this case and backend: nothing more may run in this process."""
        device = self.config.device
        judge = judge_for(check, case, backend.name, device, params)
        findings: list[Finding] = []
        for alone in (False, True):
            with device_slot(device, case, alone):
                try:
                    findings = run(self.truth(case))
                    # Inside the guard: a dead context shows here too, and is this case's. (A case that ran
                    # out of memory gives its cache back below, after its truth; a dead context has none to give.)
                    release_cached_memory(device)
                except InvalidTruth as exc:  # the case's fault, not the backend's: recorded under the suite
                    reason = f"invalid case (not {backend.name}'s error): {exc}"
                    findings = [dataclasses.replace(judge.outcome("error", reason), backend=SUITE_BACKEND)]
                    release_cached_memory(device)
                except Exception as exc:
                    if is_out_of_memory(exc):
                        findings = [judge.outcome("resource", memory_report(exc, device))]
                    elif is_sticky(exc):
                        findings = [judge.outcome("error", raised_at(exc))]
                    else:
                        raise
            if not any(f.verdict == "resource" for f in findings):
                break
            if alone:
                release_cached_memory(device)
                return [
                    dataclasses.replace(f, reason=f"{f.reason} (alone on the device)") if f.verdict == "resource" else f
                    for f in findings
                ]
            self._truths.clear()
            release_cached_memory(device)
        findings = apply_known(findings)
        lost = [f for f in findings if f.verdict == "error" and is_sticky(f.reason)]
        if lost:
            raise DeviceLost(
                findings,
                f"sticky device error in {lost[0].check} of {case.id} on {backend.name}: {lost[0].reason}; "
                "no later case may run in this process\n  repro: " + lost[0].repro,
            )
        return findings

    def record(self, findings: Sequence[Finding], test: str | None = None) -> list[dict]:
        """Add the findings' rows to the run's records (journaled at once); returns the rows."""
        rows = record_rows(findings, test)
        self.recorder.add(rows)
        return rows

    def finish(self, complete: bool = True, keep_empty: bool = False, examples: bool = True) -> dict[str, Path]:
        """Write the run's files: records and summaries with the suite's time per stage (when there are
        records, or ``keep_empty``), and the example log (when tests ran and ``examples``)."""
        written: dict[str, Path] = {}
        if examples and self.examples.entries:
            path = self.recorder.out_dir / "runs" / f"{self.recorder.run_id}.checks.json"
            text = json.dumps(self.examples.entries, indent=1)
            atomic_write(path, lambda p: p.write_text(text))
            written["checks"] = path
        if self.rows or keep_empty:
            self.frame, paths = self.recorder.finish(complete=complete, timing=CLOCK.snapshot())
            written |= paths
        return written

    def merge_workers(self, complete: bool = True) -> dict[str, Path]:
        """In the controlling process of a pytest-xdist run: the workers' parts, one run's files (the
        workers' example logs were handed over and added to this run's)."""
        config, written = self.config, {}
        stem = run_stem(config.run_id, config.part)
        runs = Path(config.out) / "runs"
        if self.examples.entries:
            text = json.dumps(self.examples.entries, indent=1)
            written["checks"] = runs / f"{stem}.checks.json"
            runs.mkdir(parents=True, exist_ok=True)
            atomic_write(written["checks"], lambda p: p.write_text(text))
        workers = run_stem(config.run_id, f"{config.part}-gw" if config.part else "gw")
        # The workers' stage totals, from their parts' files: xdist's channel loses them when a night is
        # interrupted (the controller finishes before the workers' last words reach it).
        for part_timing in sorted(runs.glob(f"{workers}*.timing.json")):
            try:
                CLOCK.absorb(json.loads(part_timing.read_text()))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                print(f"kda-conformance: {part_timing.name} unreadable, its stage times left out: {exc}")
        if any(runs.glob(f"{workers}*")):
            env = {**config.environment(), "run_id": config.run_id, "complete": complete}
            self.frame, paths = merge_parts(config.out, stem, workers, env, CLOCK.snapshot())
            written |= paths
        return written
