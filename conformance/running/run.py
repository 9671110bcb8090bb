"""One run as it goes: the executor every check runs through (``Run.checked``), its records and its example
log. Its parts are their own modules: the truth of recent cases (running/truth_cache.py), the journal of the call
in flight (running/journal.py), the quarantine (running/quarantine.py).

The command line and the pytest plugin each hold one :class:`Run`; every check goes through its executor,
and it writes the run's files when it finishes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd

from kda_cases.case import Case
from kda_cases.files import atomic_write
from kda_conformance.judging.judge import Judge, judge_for
from kda_conformance.judging.known import apply_known
from kda_conformance.running.blame import blamed, fault_finding
from kda_conformance.running.config import RunConfig
from kda_conformance.running.faults import DEVICE_LOST_EXIT, DeviceLost, is_sticky
from kda_conformance.running.hypothesis_settings import ExampleLog
from kda_conformance.running.journal import CallJournal
from kda_conformance.running.memory import device_slot, release_cached_memory, release_quietly
from kda_conformance.running.quarantine import Quarantine
from kda_conformance.running.runnable import Drawn, RunnableCheck
from kda_conformance.running.stages import CLOCK
from kda_conformance.running.truth import CaseTruth, declared_precision
from kda_conformance.running.truth_cache import TruthCache
from kda_kernels import registry, triton_interpret
from kda_kernels.guard import BackendFault
from kda_kernels.left_work import end_process
from kda_kernels.protocol import Backend, WorkingPrecision
from kda_reports.environment import library_version
from kda_reports.findings import MARGIN_REDRAWS, SUITE_BACKEND, Finding
from kda_reports.runfile import RunRecorder, merge_parts, run_file, run_path, run_stem
from kda_reports.schema import record_rows

# The observation of a case a quarantine kept from launching (a crash of its configuration earlier tonight,
# or a compile stage cut before it): nothing of the backend ran, so a drawn example's skip is no failure.
NOT_LAUNCHED = "not launched"


def with_library_tolerance(findings: Sequence[Finding], backend: Backend) -> list[Finding]:
    """The findings with the tolerance ``backend``'s library asserts on each tensor in its own tests, where it
    states one (``Finding.library_ratio`` and ``tier`` follow from it)."""
    tolerance = backend.library_tolerance
    if tolerance is None:
        return list(findings)
    return [
        dataclasses.replace(f, library_tolerance=tolerance.limit(f.tensor)) if f.tensor and f.errors else f
        for f in findings
    ]


def redraw_seeds(case: Case, count: int = MARGIN_REDRAWS) -> list[int]:
    """The seeds of a case's fresh draws: new, and the same on every machine (from the case's id)."""
    digest = hashlib.sha256(f"redraw:{case.id}".encode()).digest()
    first = int.from_bytes(digest[:4], "little")
    return [(first + n) % 2**31 for n in range(1, count + 1) if (first + n) % 2**31 != case.seed]


def on_device(judge: Judge, truth: CaseTruth) -> Judge:
    """The executor's judge for the check it runs: the same case, check, backend and repro line, with the
    device the case's inputs are on (``cuda:0`` where the run says ``cuda``), as the findings have named it."""
    return dataclasses.replace(judge, device=str(truth.inputs.device))


def _confirmed(finding: Finding, outcomes: list[tuple[int, list[Finding]]]) -> Finding:
    """``finding`` judged by what fresh draws of its case gave for the same tensor: a failure where most of the
    draws that counted failed it too, ``marginal`` otherwise."""
    said, failed, counted = [], 0, 0
    for seed, found in outcomes:
        same = [f for f in found if (f.tensor, f.subject) == (finding.tensor, finding.subject)]
        same = same or [f for f in found if f.tensor == finding.tensor] or [f for f in found if not f.tensor]
        if not same or all(f.verdict in ("resource", "skip") for f in same):
            said.append(f"seed {seed} not judged")
            continue
        counted += 1
        worst = max((f.worst for f in same if not math.isnan(f.worst)), default=math.nan)
        bad = any(f.failed for f in same)
        failed += bad
        said.append(f"seed {seed} {'failed' if bad else 'passed'}" + ("" if math.isnan(worst) else f" {worst:.3g}x"))
    text = f"{failed} of {counted} fresh draws of the case failed it ({', '.join(said)})"
    if counted and failed * 2 > counted:
        return dataclasses.replace(finding, redraws=f"confirmed: {text}")
    reason = f"{finding.worst:.3g}x its limit, not confirmed: {text}"
    return dataclasses.replace(finding, verdict="marginal", redraws=f"not confirmed: {text}", reason=reason)


def _interpreter_first(config: RunConfig) -> None:
    """On a CPU, switch Triton's interpreter on before anything imports triton where a backend of the run runs
    in it, as the pytest plugin does for its session: the float64 gradients' checkpointing imports triton
    through torch._dynamo before the backend is first called, and ``kda-conformance repro --device cpu
    --backend fla_chunk --check gradients`` stopped there ("triton was imported before the Triton interpreter
    was switched on"). Where triton came in earlier anyway, the backend's own call says so."""
    if config.device.type != "cpu" or triton_interpret.problem():
        return
    known = set(registry.names())
    interpreted = [name for name in config.backends if name in known]
    if any(triton_interpret.VARIABLE in registry.get(name).sets_environment for name in interpreted):
        triton_interpret.enable()


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
        # Backends whose availability raised instead of answering: each check of theirs is that error.
        self.unanswered: dict[str, BackendFault] = {}
        self._recorded: set[tuple] = set()
        self.examples = ExampleLog()
        self.truths = TruthCache(config.device)
        self.calls = CallJournal(lambda: self.recorder, self._rows)
        self._declared: dict[str, dict[str, str]] = {}  # backend -> its library (and version) and code hash
        self._recorder: RunRecorder | None = None
        self.frame: pd.DataFrame | None = None  # the records as written, once the run finished
        # (backend, kernel configuration) pairs that crashed the device this night, on this host.
        self.quarantine = Quarantine(run_file(config.out, config.run_id, config.part, "quarantine"))
        _interpreter_first(config)

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

    def checked(self, check: RunnableCheck, drawn: Drawn, backend: Backend, test: str | None = None) -> list[Finding]:
        """``check`` on the ``drawn`` case and parameters, for ``backend``: the one path from a check to its
        findings (the sweep, pytest, ``repro``, ``minimize``, ``checks --run``, ``findings --write-tests`` and
        isolated workers all come here). It holds the device (alone for a large case). Whatever goes
        wrong is a finding that names who is at fault: ``backend`` (its call raised, broke the call contract,
        or left the device context dead), the suite (``(suite)``, with the stage that raised), or the machine
        (``resource``: out of memory in any stage, once more alone on the device). Known issues of the ledger
        are marked as such. A sticky device error raises DeviceLost with the finding that charges it to this
        case and backend: nothing more may run in this process, and the case's kernel configuration is
        quarantined on that backend for the rest of the night (running/quarantine.py). While a backend call is
        in flight the run's journal says so, so that a process that ends inside it leaves an error row naming
        it (``test``: the pytest node id the row carries)."""
        case, params = drawn.case, dict(drawn.params)
        judge = judge_for(check.name, case, backend.name, self.config.device, params)
        if self.journal:
            self.calls.open(judge, test)
        unanswered = self.unanswered.get(backend.name)
        quarantined = self.quarantine.find(backend.name, case)
        # The backend's timeout starts once the case's truth is ready: the suite's drawing, truth and baseline
        # and its wait for a share of the GPU are not the backend's time (an instant backend on T = 1024 was
        # charged "no result within 1.5 s" for them); until then a hang is the suite's.
        watchdogs = {"suite": self._watchdog(judge, suite=True), "check": None}

        def check_run(truth: CaseTruth) -> list[Finding]:
            if watchdogs["check"] is None:
                if watchdogs["suite"] is not None:
                    watchdogs["suite"].cancel()
                watchdogs["check"] = self._watchdog(judge)
            return check.run(truth, backend, params, on_device(judge, truth))

        try:
            if unanswered:
                findings = [fault_finding(judge, unanswered)]
            elif quarantined:  # crashed the device earlier tonight, or was not compiled: not launched
                findings = [
                    dataclasses.replace(judge.outcome(quarantined.verdict, quarantined.reason), observed=NOT_LAUNCHED)
                ]
            else:
                precision = declared_precision(backend, self.config.device)
                findings = self._attempts(judge, check_run, precision)
                findings = self._confirm_margins(check, drawn, backend, findings, precision)
        except BaseException:
            self.calls.settle()  # an interrupt: nothing of this call is recorded, and nothing died in it
            raise
        finally:
            for watchdog in watchdogs.values():
                if watchdog is not None:
                    watchdog.cancel()
        # A quarantined case launched nothing: its reason names the earlier crash, but this context is alive.
        # Taken before the ledger: a device left dead is never a known issue's to keep running on.
        lost = [f for f in findings if f.verdict == "error" and is_sticky(f.reason)] if not quarantined else []
        findings = apply_known(with_library_tolerance(findings, backend))
        if lost:
            self.quarantine.add(backend.name, case, check.name, lost[0].reason)
            raise DeviceLost(
                findings,
                f"sticky device error in {lost[0].check} of {case.id} on {backend.name}: {lost[0].reason}; "
                "no later case may run in this process\n  repro: " + lost[0].repro,
            )
        return findings

    def _confirm_margins(
        self,
        check: RunnableCheck,
        drawn: Drawn,
        backend: Backend,
        findings: list[Finding],
        precision: WorkingPrecision | None,
    ) -> list[Finding]:
        """A failure within MARGIN of its limits counts only if fresh draws of its case (the same shape and
        regimes, new seeds: ``redraw_seeds``) fail too: the check is run on ``config.redraws`` of them, and where
        most do not fail the same tensor, the failure is ``marginal`` (shown, never red). Either way the
        finding says what the draws gave (``redraws``). A crash on a draw counts as a failure of it; a draw that
        did not fit the device's memory does not count."""
        if not any(f.within_margin for f in findings) or not self.config.redraws:
            return findings
        outcomes: list[tuple[int, list[Finding]]] = []
        for seed in redraw_seeds(drawn.case, self.config.redraws):
            case = drawn.case.replace(seed=seed)
            judge = judge_for(check.name, case, backend.name, self.config.device, dict(drawn.params))

            def redrawn(truth: CaseTruth, judge: Judge = judge) -> list[Finding]:
                return check.run(truth, backend, drawn.params, on_device(judge, truth))

            found = self._attempts(judge, redrawn, precision)
            self.truths.clear()
            outcomes.append((seed, found))
        return [_confirmed(f, outcomes) if f.within_margin else f for f in findings]

    def _attempts(
        self, judge: Judge, run: Callable[[CaseTruth], list[Finding]], precision: WorkingPrecision | None = None
    ) -> list[Finding]:
        """The check's findings on the case's truth (at ``precision``, a backend's declared one), retried once
        alone on the device after running out of memory."""
        device, case = self.config.device, judge.case
        findings: list[Finding] = []
        self.truths.draw_ahead(case)  # the CPU's part, before the case holds GPU memory others wait for
        for alone in (False, True):

            def attempt(alone: bool = alone) -> list[Finding]:
                with device_slot(device, case, alone):
                    findings = run(self.truths.get(case, precision))
                    findings += [
                        dataclasses.replace(judge.outcome("warn", f"a backend's call {said}"), backend=SUITE_BACKEND)
                        for said in self.truths.take_spoiled()
                    ]
                    self.truths.trim()
                    # Inside the guard: a dead context shows here too, and is this case's.
                    release_cached_memory(device)
                return findings

            findings = blamed(judge, device, attempt)
            if not any(f.verdict == "resource" for f in findings):
                return findings
            self.truths.clear()
            release_quietly(device)
            if alone:
                return [
                    dataclasses.replace(f, reason=f"{f.reason} (alone on the device)") if f.verdict == "resource" else f
                    for f in findings
                ]
        return findings

    def _watchdog(self, judge: Judge, suite: bool = False) -> threading.Timer | None:
        """With a case timeout: a timer that records the case as hung and ends the process (a hung kernel
        never returns to Python, so the timer's thread does it; pytest-xdist replaces such a worker).
        ``suite``: the timer of the suite's own work on the case (its truth, its wait for GPU memory), whose
        hang is charged to the suite."""
        timeout = self.config.case_timeout
        if not timeout or not self.journal:
            return None
        test = self.calls.test

        def hung() -> None:
            if suite:
                reason = (
                    f"the suite's truth of the case (drawing, reference, baseline or its wait for GPU memory) took "
                    f"more than {timeout:g} s: its process was ended"
                )
                finding = dataclasses.replace(judge.outcome("error", reason, timeout), backend=SUITE_BACKEND)
            else:
                reason = f"no result within {timeout:g} s (hung or too slow): its process was ended"
                finding = judge.outcome("error", reason, timeout)
            self.record([finding], test)
            sys.stderr.write(f"kda-conformance: {judge.check} of {judge.case.id} on {finding.backend}: {reason}\n")
            sys.stderr.flush()
            end_process(self.hung_exit)

        timer = threading.Timer(timeout, hung)
        timer.daemon = True
        timer.start()
        return timer

    def _rows(self, findings: Sequence[Finding], test: str | None) -> list[dict]:
        """The findings' records, each naming the library (and version) its backend declares and the hash of
        the backend's own source."""
        return [{**row, **self._code(row["backend"])} for row in record_rows(findings, test)]

    def _code(self, backend: str) -> dict[str, str]:
        if backend not in self._declared:
            try:
                made = registry.get(backend)
            except (KeyError, registry.PluginError):  # the suite's own findings, a backend gone since
                made = None
            declared = made.libraries if made is not None else ()
            library = "; ".join(
                f"{lib.name} {library_version(lib.distribution, lib.source_variable)}" for lib in declared
            )
            code = registry.code_of(backend, made) if made is not None else ""
            self._declared[backend] = {"library": library, "backend_code": code}
        return self._declared[backend]

    def record(self, findings: Sequence[Finding], test: str | None = None) -> list[dict]:
        """Add the findings' rows to the run's records (journaled at once), each (check, case, backend, tensor,
        what it compared, repro) once: Hypothesis replays a failing example, which measures it again. The
        call in flight, if any, is settled. Returns the rows added."""
        rows = []
        for row in self._rows(findings, test):
            key = (row["check"], row["case_id"], row["backend"], row["tensor"], row["subject"], row["repro"])
            if key not in self._recorded:
                self._recorded.add(key)
                rows.append(row)
        if rows:
            self.recorder.add(rows)
        self.calls.settle()
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
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                print(f"kda-conformance: {part_timing.name} unreadable, its stage times left out: {exc}")
        if any(runs.glob(f"{workers}*")):
            env = {**config.environment(), "run_id": config.run_id, "complete": complete}
            self.frame, paths = merge_parts(config.out, stem, workers, env, CLOCK.snapshot())
            written |= paths
        return written
