"""One run as it goes: its configuration, the truth of its recent cases, its records, its example log.

The command line and the pytest plugin each hold one :class:`Run`; checks ask it for a case's truth and
hand it their findings, and it writes the run's files when it finishes.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from kda_cases.case import Case
from kda_conformance.running.config import RunConfig
from kda_conformance.running.search import ExampleLog
from kda_conformance.running.stages import CLOCK
from kda_conformance.running.truth import CaseTruth, case_truth
from kda_reports.findings import Finding
from kda_reports.runfile import RunRecorder, atomic_write
from kda_reports.schema import record_rows

# Long GPU cases hold gigabytes of truth; a handful is enough for every backend to reuse a case.
TRUTH_CACHE_SIZE = 4


class Run:
    """A run's state: created by a front end from its :class:`RunConfig`."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.examples = ExampleLog()
        self._truths: OrderedDict[str, CaseTruth] = OrderedDict()
        self._recorder: RunRecorder | None = None
        self.frame: pd.DataFrame | None = None  # the records as written, once the run finished

    @property
    def recorder(self) -> RunRecorder:
        """The run's recorder, made at its first record (it names the run and starts its journal)."""
        if self._recorder is None:
            self._recorder = RunRecorder(self.config.environment(), self.config.out)
        return self._recorder

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

    def record(self, findings: Sequence[Finding], test: str | None = None) -> list[dict]:
        """Add the findings' rows to the run's records (journaled at once); returns the rows."""
        rows = record_rows(findings, test)
        self.recorder.add(rows)
        return rows

    def finish(self, complete: bool = True, keep_empty: bool = False) -> dict[str, Path]:
        """Write the run's files: records and summaries with the suite's time per stage (when there are
        records, or ``keep_empty``), and the example log (when tests ran)."""
        written: dict[str, Path] = {}
        if self.examples.entries:
            path = self.recorder.out_dir / "runs" / f"{self.recorder.run_id}.checks.json"
            text = json.dumps(self.examples.entries, indent=1)
            atomic_write(path, lambda p: p.write_text(text))
            written["checks"] = path
        if self.rows or keep_empty:
            self.frame, paths = self.recorder.finish(complete=complete, timing=CLOCK.snapshot())
            written |= paths
        return written
