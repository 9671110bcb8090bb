"""Cases in a worker process, so a backend that crashes or hangs costs one case, not the night.

A CUDA fault (illegal memory access) poisons the process that hit it, a segfault or an abort ends it, a
hang never returns: in the sweep's own process any of them ends the night. Here one worker process runs
the cases one at a time; when it dies, the case it was running is recorded as an error (with the signal or
exit code and the repro line) and a fresh worker takes the next case; when a case passes its time limit
the worker is killed and the same happens. A worker that catches a sticky device error sends that case's
error and ends itself, so that no later case runs on its dead context.
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing
import os
import signal
import time
from collections.abc import Generator, Iterable, Sequence
from multiprocessing.connection import Connection

import torch

from kda_cases.case import Case
from kda_conformance.judging.judge import judge_for
from kda_conformance.running.config import RunConfig
from kda_conformance.running.faults import DEVICE_LOST_EXIT, DeviceLost, die_with_parent
from kda_conformance.running.option_values import DEFAULT_CASE_TIMEOUT
from kda_conformance.running.run import Run
from kda_conformance.running.runnable import Drawn, RunnableCheck
from kda_conformance.running.stages import CLOCK
from kda_kernels.left_work import exit_past_left_work, kill_tree
from kda_reports.findings import MARGIN_REDRAWS, SUITE_BACKEND, Finding

STARTUP_TIMEOUT = 600.0  # seconds for a fresh worker to import torch, the suite and the plugins
CLOCK_EVENT = "clock"  # a worker's word that a backend call starts ("call") or has returned ("returned")


def _worker(conn: Connection, device: str, plugins: list[str], parent_pid: int, redraws: int) -> None:
    from kda_kernels import guard, registry

    die_with_parent(parent_pid)

    def clock(event: str, backend: object) -> None:  # the parent times each backend call on its own clock
        if event in ("call", "returned"):
            conn.send((CLOCK_EVENT, event))

    guard.add_listener(clock)

    for module in plugins:
        registry.load_plugin(module)
    config = RunConfig(device=torch.device(device), backends=(), redraws=redraws)
    run = Run(config, journal=False)  # the parent records
    conn.send("ready")  # the case clock starts after the imports (and a GPU's context) are done
    while True:
        task = conn.recv()
        if task is None:
            exit_past_left_work(0)  # a thread a backend left would hold the worker's exit forever
            return
        check, case_json, params, backend_name = task
        drawn, backend = Drawn(Case.from_json(case_json), params), registry.get(backend_name)
        try:  # one case's truth serves all its backends (the run keeps the last few)
            findings = run.checked(check, drawn, backend)
        except DeviceLost as lost:
            conn.send((lost.findings, CLOCK.drain(), True))  # True: this worker ends
            conn.close()
            os._exit(DEVICE_LOST_EXIT)  # the context is dead; the runner starts a fresh worker
        conn.send((findings, CLOCK.drain(), False))


class IsolatedRunner:
    """One worker process at a time, restarted after a crash or a hang."""

    def __init__(
        self,
        device: torch.device,
        plugins: Sequence[str] = (),
        case_timeout: float = DEFAULT_CASE_TIMEOUT,
        redraws: int = MARGIN_REDRAWS,
    ):
        self.device, self.plugins, self.case_timeout, self.redraws = device, list(plugins), case_timeout, redraws
        self.context = multiprocessing.get_context("spawn")  # no CUDA context may be forked
        self.process: multiprocessing.process.BaseProcess | None = None
        self.conn: Connection | None = None

    def _start(self) -> None:
        parent, child = self.context.Pipe()
        self.process = self.context.Process(
            target=_worker, args=(child, str(self.device), self.plugins, os.getpid(), self.redraws), daemon=False
        )  # not daemonic: a backend may start worker processes of its own (a daemonic process may not)
        self.process.start()
        # A non-daemonic worker is joined when this process exits: one hung in a kernel would hold the exit.
        # Killed first (atexit runs this before multiprocessing's join, registered later).
        atexit.register(self._discard)
        child.close()
        self.conn = parent
        if not parent.poll(STARTUP_TIMEOUT) or parent.recv() != "ready":
            self._discard()
            raise RuntimeError(f"the worker process did not start within {STARTUP_TIMEOUT:g} s")

    def _discard(self) -> None:
        atexit.unregister(self._discard)
        if self.process is not None and self.process.pid is not None and self.process.is_alive():
            kill_tree(self.process.pid)  # with the children a backend left in it, which hold our pipes
        if self.process is not None:
            self.process.join(timeout=30)
        self.process, self.conn = None, None

    def run(self, check: RunnableCheck, drawn: Drawn, backend: str) -> list[Finding]:
        """``check`` on the drawn case for ``backend`` in the worker (the check travels as itself: its fields
        are data and module-level functions), the worker's executor applying every rule the sweep's does."""
        if self.process is None:
            self._start()
        assert self.conn is not None and self.process is not None
        start = time.perf_counter()
        case = drawn.case
        self.conn.send((check, case.to_json(), dict(drawn.params), backend))
        judge = judge_for(check.name, case, backend, self.device, drawn.params)
        # Two clocks, each of the timeout: a backend's call from its start to its return is the backend's; the
        # suite's work around it (drawing, the truth, the baseline, comparing) is the suite's.
        in_call, since = False, time.perf_counter()
        while True:
            if not self.conn.poll(max(0.0, since + self.case_timeout - time.perf_counter())):
                self._discard()
                if in_call:
                    reason = f"no result within {self.case_timeout:g} s (hung or too slow): its process was killed"
                    return [judge.outcome("error", reason, time.perf_counter() - since)]
                reason = (
                    f"the suite's own work on the case (drawing, truth, baseline, comparing) took more than "
                    f"{self.case_timeout:g} s at a stretch: its process was killed (not {backend}'s error)"
                )
                return [dataclasses.replace(judge.outcome("error", reason), backend=SUITE_BACKEND)]
            try:
                message = self.conn.recv()
            except (EOFError, ConnectionError):
                self.process.join(timeout=30)
                reason = f"the backend's process died ({_exit_status(self.process.exitcode)}); the night went on"
                self._discard()
                return [judge.outcome("error", reason, time.perf_counter() - start)]
            if len(message) == 2 and message[0] == CLOCK_EVENT:
                in_call, since = message[1] == "call", time.perf_counter()
                continue
            findings, stages, ending = message
            CLOCK.absorb(stages)
            if ending:  # it ends itself after a sticky device error: the next case gets a fresh one
                self._discard()
            return findings

    def close(self) -> None:
        if self.conn is not None and self.process is not None and self.process.is_alive():
            try:
                self.conn.send(None)
                self.process.join(timeout=10)
            except (BrokenPipeError, OSError):
                pass
        self._discard()


def _exit_status(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def run_isolated(
    check: RunnableCheck,
    calls: Iterable[tuple[Case, str]],
    device: torch.device,
    plugins: Sequence[str] = (),
    case_timeout: float = DEFAULT_CASE_TIMEOUT,
    redraws: int = MARGIN_REDRAWS,
) -> Generator[list[Finding], None, None]:
    """``check`` on each (case, backend) of ``calls``, every case in a worker process (see the module's
    docstring)."""
    runner = IsolatedRunner(device, plugins, case_timeout, redraws)
    try:
        for case, backend in calls:
            yield runner.run(check, Drawn(case), backend)
    finally:
        runner.close()
