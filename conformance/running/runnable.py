"""A check as the executor (``Run.checked``) runs it: what it drew (:class:`Drawn`), and the two things the
executor asks of it (:class:`RunnableCheck`). What a check is, with its drawing and its parameters, is
``checks/_check.py``; the checks themselves are ``conformance/checks/``, one module each."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from kda_cases.case import Case
from kda_conformance.judging.judge import Judge
from kda_conformance.running.truth import CaseTruth
from kda_kernels.protocol import Backend
from kda_reports.findings import Finding


@dataclass(frozen=True)
class Drawn:
    """What a check drew: the case it runs on and its parameters."""

    case: Case
    params: Mapping[str, object] = field(default_factory=dict)


class RunnableCheck(Protocol):
    """What the executor needs of a check: the name its findings carry, and how it runs on a case's truth
    with the judge the executor made for the call (its findings carry that judge's repro line)."""

    @property
    def name(self) -> str: ...

    def run(
        self, truth: CaseTruth, backend: Backend, params: Mapping[str, object], judge: Judge, /
    ) -> list[Finding]: ...
