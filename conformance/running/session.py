"""One run as it goes: its configuration, the truth of its recent cases, its records, its example log.

The command line and the pytest plugin each hold one :class:`Run`; checks ask it for a case's truth and
hand it their findings, and it writes the run's files when it finishes.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pandas as pd
import torch

from kda_cases.case import Case
from kda_cases.files import atomic_write
from kda_conformance.judging.judge import Judge, judge_for
from kda_conformance.judging.known import apply_known
from kda_conformance.running.config import RunConfig
from kda_conformance.running.faults import DEVICE_LOST_EXIT, DeviceLost, is_sticky
from kda_conformance.running.memory import TRUTH_CACHE_GIB, device_slot, release_cached_memory, release_quietly
from kda_conformance.running.runner import blamed, fault_finding
from kda_conformance.running.search import ExampleLog
from kda_conformance.running.stages import CLOCK
from kda_conformance.running.truth import CaseTruth, case_truth
from kda_kernels.guard import BackendFault, add_listener, end_process, remove_listener
from kda_kernels.protocol import Backend
from kda_reports.findings import Finding
from kda_reports.quarantine import Quarantine
from kda_reports.runfile import CALL, RETURNED, SETTLED, RunRecorder, merge_parts, run_file, run_path, run_stem
from kda_reports.schema import record_rows

# Long GPU cases hold gigabytes of truth; a handful is enough for every backend to reuse a case. Between cases
# a worker keeps at most TRUTH_CACHE_GIB of them (memory outside the GPU's shares, in the night's memory plan).
TRUTH_CACHE_SIZE = 4


def tensor_bytes(value: object) -> int:
    """The bytes of every tensor in ``value`` (a tensor, a dataclass, a mapping or a sequence of them)."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(tensor_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, Mapping):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    return 0


class Run:
    """A run's state: created by a front end from its :class:`RunConfig`."""

    def __init__(
        self, config: RunConfig, worker: str | None = None, journal: bool = True, hung_exit: int = DEVICE_LOST_EXIT
    ) -> None:
        self.config = config
        # A pytest-xdist worker writes a part of the run of its own; the controller merges the parts.
        self.worker = worker
        # Whether this process's records are the run's: an isolated case's process sends its findings to
        # the process that records them, and journals nothing itself.
        self.journal = journal
        self.hung_exit = hung_exit  # the exit code of a process ended by the case timeout
        self._call: dict | None = None  # the check whose backend call the journal marks as in flight
        # Backends whose availability raised instead of answering: each check of theirs is that error.
        self.unanswered: dict[str, BackendFault] = {}
        self._recorded: set[tuple] = set()
        self.examples = ExampleLog()
        self._truths: OrderedDict[str, CaseTruth] = OrderedDict()
        self._recorder: RunRecorder | None = None
        self.frame: pd.DataFrame | None = None  # the records as written, once the run finished
        # (backend, kernel configuration) pairs that crashed the device this night, on this host.
        self.quarantine = Quarantine(run_file(config.out, config.run_id, config.part, "quarantine"))

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
        self._truths.move_to_end(case.id)
        return self._truths[case.id]

    def trim_truths(self) -> None:
        """Keep what the memory plan allows between cases: at most TRUTH_CACHE_SIZE truths and TRUTH_CACHE_GIB
        of them, the oldest dropped first (the case just run too, when it alone is larger)."""
        while len(self._truths) > TRUTH_CACHE_SIZE:
            self._truths.popitem(last=False)
        while self._truths and sum(map(tensor_bytes, self._truths.values())) > TRUTH_CACHE_GIB * 2**30:
            self._truths.popitem(last=False)

    def checked(
        self,
        check: str,
        case: Case,
        backend: Backend,
        params: Mapping[str, object],
        run: Callable[[CaseTruth], list[Finding]],
        test: str | None = None,
    ) -> list[Finding]:
        """``run(truth)`` of ``check`` on ``case``, holding the device (alone for a large case). Whatever goes
        wrong is a finding that names who is at fault: ``backend`` (its call raised, broke the call contract,
        or left the device context dead), the suite (``(suite)``, with the stage that raised), or the machine
        (``resource``: out of memory in any stage, once more alone on the device). A sticky device error
        raises DeviceLost with the finding that charges it to this case and backend: nothing more may run
        in this process, and the case's kernel configuration is quarantined on that backend for the rest
        of the night (reports/quarantine.py). While a backend call is in flight the run's journal says so,
        so that a process that ends inside it leaves an error row naming it (``test``: the pytest node id
        the row carries)."""
        judge = judge_for(check, case, backend.name, self.config.device, params)
        self._open_call(judge, test)
        unanswered = self.unanswered.get(backend.name)
        quarantined = self.quarantine.find(backend.name, case)
        watchdog = self._watchdog(judge)
        try:
            if unanswered:
                findings = [fault_finding(judge, unanswered)]
            elif quarantined:  # its configuration crashed the device earlier tonight: not launched again
                findings = [judge.outcome("error", quarantined.reason)]
            else:
                findings = self._attempts(judge, run)
        except BaseException:
            self._settle()  # an interrupt: nothing of this call is recorded, and nothing died in it
            raise
        finally:
            if watchdog is not None:
                watchdog.cancel()
        findings = apply_known(findings)
        # A quarantined case launched nothing: its reason names the earlier crash, but this context is alive.
        lost = [f for f in findings if f.verdict == "error" and is_sticky(f.reason)] if not quarantined else []
        if lost:
            self.quarantine.add(backend.name, case, check, lost[0].reason)
            raise DeviceLost(
                findings,
                f"sticky device error in {lost[0].check} of {case.id} on {backend.name}: {lost[0].reason}; "
                "no later case may run in this process\n  repro: " + lost[0].repro,
            )
        return findings

    def _attempts(self, judge: Judge, run: Callable[[CaseTruth], list[Finding]]) -> list[Finding]:
        """The check's findings, retried once alone on the device after running out of memory."""
        device, case = self.config.device, judge.case
        findings: list[Finding] = []
        for alone in (False, True):

            def attempt(alone: bool = alone) -> list[Finding]:
                with device_slot(device, case, alone):
                    findings = run(self.truth(case))
                    self.trim_truths()
                    # Inside the guard: a dead context shows here too, and is this case's.
                    release_cached_memory(device)
                return findings

            findings = blamed(judge, device, attempt)
            if not any(f.verdict == "resource" for f in findings):
                return findings
            self._truths.clear()
            release_quietly(device)
            if alone:
                return [
                    dataclasses.replace(f, reason=f"{f.reason} (alone on the device)") if f.verdict == "resource" else f
                    for f in findings
                ]
        return findings

    def _watchdog(self, judge: Judge) -> threading.Timer | None:
        """With a case timeout: a timer that records the case as hung and ends the process (a hung kernel
        never returns to Python, so the timer's thread does it; pytest-xdist replaces such a worker)."""
        timeout = self.config.case_timeout
        if not timeout or not self.journal:
            return None
        test = self._call["test"] if self._call else None

        def hung() -> None:
            reason = f"no result within {timeout:g} s (hung or too slow): its process was ended"
            self.record([judge.outcome("error", reason, timeout)], test)
            sys.stderr.write(f"kda-conformance: {judge.check} of {judge.case.id} on {judge.backend}: {reason}\n")
            sys.stderr.flush()
            end_process(self.hung_exit)

        timer = threading.Timer(timeout, hung)
        timer.daemon = True
        timer.start()
        return timer

    def _open_call(self, judge: Judge, test: str | None) -> None:
        """From the first backend call of this check on, the journal names the call in flight."""
        self._settle()
        if not self.journal:
            return
        self._call = {"id": secrets.token_hex(8), "judge": judge, "test": test, "marked": False}
        add_listener(self._on_call)

    def _on_call(self, event: str, backend: Backend) -> None:
        call = self._call
        if call is None or backend.name != call["judge"].backend:
            return  # the baseline's call (in the truth) is the suite's stage: its death is not this backend's
        if event == "call" and not call["marked"]:
            judge = call["judge"]
            reason = (
                f"the process ended during {backend.name}'s call in check {judge.check} (os._exit, a signal, an "
                "abort or a kill: no exception reached the suite)"
            )
            [row] = record_rows([judge.outcome("error", reason)], call["test"])
            self.recorder.mark(CALL, call["id"], row)
            call["marked"] = True
        elif call["marked"]:
            self.recorder.mark(CALL if event == "call" else RETURNED, call["id"])

    def _settle(self) -> None:
        call, self._call = self._call, None
        remove_listener(self._on_call)
        if call is not None and call["marked"]:
            self.recorder.mark(SETTLED, call["id"])

    def record(self, findings: Sequence[Finding], test: str | None = None) -> list[dict]:
        """Add the findings' rows to the run's records (journaled at once), each (check, case, backend, tensor,
        what it compared, repro) once: Hypothesis replays a failing example, which measures it again. The
        call in flight, if any, is settled. Returns the rows added."""
        rows = []
        for row in record_rows(findings, test):
            key = (row["check"], row["case_id"], row["backend"], row["tensor"], row["subject"], row["repro"])
            if key not in self._recorded:
                self._recorded.add(key)
                rows.append(row)
        if rows:
            self.recorder.add(rows)
        self._settle()
        return rows

    def finish(self, complete: bool = True, keep_empty: bool = False, examples: bool = True) -> dict[str, Path]:
        """Write the run's files: records and summaries with the suite's time per stage (when there are
        records, or ``keep_empty``), and the example log (when tests ran and ``examples``)."""
        written: dict[str, Path] = {}
        if examples and self.examples.entries:
            path = run_path(self.recorder.out_dir, self.recorder.run_id, "checks")
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
            written["checks"] = run_path(config.out, stem, "checks")
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
