"""The registry of checks (what a check is: ``_check.py``), how a check draws its case inside a backend's
envelope, and ``run_check``: one check on one case through the run's executor (``Run.checked``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import torch
from hypothesis import assume
from hypothesis import strategies as st

from kda_cases.case import Case, did_you_mean
from kda_cases.profiles import Profile
from kda_cases.strategies import cases
from kda_conformance.checks._check import Check, unchanged
from kda_conformance.running.config import RunConfig
from kda_conformance.running.run import Run
from kda_conformance.running.runnable import Drawn
from kda_kernels import guard
from kda_kernels.protocol import Backend
from kda_reports.findings import Finding

CHECKS: dict[str, Check] = {}


def register(check: Check) -> Check:
    if check.name in CHECKS:
        raise ValueError(f"a check named {check.name!r} is already registered")
    CHECKS[check.name] = check
    return check


def get_check(name: str) -> Check:
    if name not in CHECKS:
        raise ValueError(f"check {name!r} unknown{did_you_mean(name, CHECKS)}; choose from {', '.join(CHECKS)}")
    return CHECKS[name]


def draw_case(
    data: st.DataObject, profile: Profile, backend: Backend, prepare: Callable[[Case, Backend], Case] = unchanged
) -> Case:
    """A case of ``profile`` drawn inside ``backend``'s envelope (its ``fit`` applied for what the record
    cannot say), prepared for the check."""
    fit = functools.partial(guard.fit, backend)
    drawn = cases(profile, guard.envelope(backend))
    return data.draw(drawn.map(fit).map(lambda case: prepare(case, backend)), label="case")


# Per backend, how many drawn cases its ``supports()`` refused and the last reason it gave: a plugin that
# refuses most of what the suite draws (``supports()`` written instead of an ``Envelope``) makes Hypothesis give
# up, and the test says it is the plugin's configuration, with these numbers.
REFUSALS: dict[str, tuple[int, str]] = {}


def supported(backend: Backend, case: Case) -> None:
    """Outside the backend's envelope there is nothing to check for this example (not a failure)."""
    support = guard.supports(backend, case)
    if not support:
        refused, _ = REFUSALS.get(backend.name, (0, ""))
        REFUSALS[backend.name] = (refused + 1, support.reason)
    assume(bool(support))


def run_check(
    check: Check,
    case: Case,
    backend: Backend,
    device: torch.device,
    params: Mapping[str, object] | None = None,
    run: Run | None = None,
) -> list[Finding]:
    """``check`` on ``case`` (prepared for it) with ``params``, outside any Hypothesis test (what a repro line
    reruns), through ``run``'s executor: the journal, the quarantine, the watchdog, the out-of-memory retry
    and the ledger of known issues apply as in the sweep. Without ``run``, a run of its own that journals
    nothing (a test's, a tool's)."""
    if run is None:
        run = Run(RunConfig(device=device, backends=(backend.name,)), journal=False)
    return run.checked(check, Drawn(check.prepare(case, backend), dict(params or {})), backend)
