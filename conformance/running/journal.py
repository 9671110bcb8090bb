"""The journal of the backend call in flight: while a check's backend call runs, the run's journal holds an
error row naming it, settled when the call returns and its findings are recorded. A process that ends inside
the call (os._exit, a signal, an abort, a kill) leaves that row, which the controlling pytest process, the
next run into the store or the dashboard reads back (reports/runfile.py)."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

from kda_conformance.judging.judge import Judge
from kda_kernels.guard import add_listener, remove_listener
from kda_kernels.protocol import Backend
from kda_reports.findings import Finding
from kda_reports.runfile import CALL, RETURNED, SETTLED, RunRecorder


class CallJournal:
    """Marks one check's backend calls in the run's journal (``recorder``: the run's, made on first use;
    ``rows``: how the run turns findings into records)."""

    def __init__(
        self, recorder: Callable[[], RunRecorder], rows: Callable[[Sequence[Finding], str | None], list[dict]]
    ) -> None:
        self._recorder, self._rows = recorder, rows
        self._call: dict | None = None

    @property
    def test(self) -> str | None:
        """The pytest node id of the call in flight (None outside pytest, or with no call open)."""
        return self._call["test"] if self._call else None

    def open(self, judge: Judge, test: str | None) -> None:
        """From the first backend call of this check on, the journal names the call in flight."""
        self.settle()
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
            [row] = self._rows([judge.outcome("error", reason)], call["test"])
            self._recorder().mark(CALL, call["id"], row)
            call["marked"] = True
        elif call["marked"] and event in ("call", "returned"):  # the suite's work inside a call is the call's
            self._recorder().mark(CALL if event == "call" else RETURNED, call["id"])

    def settle(self) -> None:
        """The call in flight returned and its findings are recorded (or nothing of it is): not in flight."""
        call, self._call = self._call, None
        remove_listener(self._on_call)
        if call is not None and call["marked"]:
            self._recorder().mark(SETTLED, call["id"])
