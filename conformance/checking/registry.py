"""The registry of checks and the shape of one check."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from hypothesis import assume
from hypothesis import strategies as st

from kda_cases.case import Case
from kda_cases.profiles import Profile
from kda_cases.strategies import cases
from kda_conformance.judging.judge import judge_for
from kda_conformance.running.runner import blamed
from kda_conformance.running.truth import CaseTruth, case_truth
from kda_kernels import guard
from kda_kernels.protocol import Backend
from kda_reports.findings import Finding


@dataclass(frozen=True)
class Param:
    """A parameter a check draws besides its case (a split point, a poison mode). Its name is also the
    option of ``kda-conformance repro`` that sets it (``--at 17``), so a repro line can rerun the check."""

    name: str
    parse: Callable[[str], object]
    help: str
    choices: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Drawn:
    """What a check drew: the case it runs on and its parameters."""

    case: Case
    params: Mapping[str, object] = field(default_factory=dict)


def unchanged(case: Case, backend: Backend) -> Case:
    return case


@dataclass(frozen=True)
class Check:
    """One check. ``prepare`` turns a drawn (or a given) case into the case the check runs on (packed for
    the serving checks, say); it must leave such a case unchanged. ``draw`` draws the case and the
    parameters inside a Hypothesis test, rejecting (``assume``) what the backend does not take; ``run``
    checks the backend on a case's truth with those parameters."""

    name: str  # what findings, ``repro --check`` and the run's example log call it
    title: str  # how tables show it
    suite: str  # the pytest module its test lives in: "properties" or "serving"
    test_name: str  # its pytest test function
    summary: str
    draw: Callable[[st.DataObject, Profile, Backend], Drawn]
    run: Callable[[CaseTruth, Backend, Mapping[str, object]], list[Finding]]
    # The seed its cases are drawn from in derandomized profiles (ci, smoke): fixed, so that changing the
    # check's code does not change the cases CI draws. Each is the digest Hypothesis derived from the
    # check's test function before the checks moved into this registry, which kept the ci cases and the
    # detection table as they were.
    ci_seed: int
    prepare: Callable[[Case, Backend], Case] = unchanged
    params: tuple[Param, ...] = ()
    targets: bool = False  # in a targeted profile, its error/limit ratios steer Hypothesis toward the worst cases
    requires: Callable[[Backend], str | None] = lambda backend: None  # why it cannot apply to a backend


CHECKS: dict[str, Check] = {}


def register(check: Check) -> Check:
    if check.name in CHECKS:
        raise ValueError(f"a check named {check.name!r} is already registered")
    CHECKS[check.name] = check
    return check


def get_check(name: str) -> Check:
    if name not in CHECKS:
        raise ValueError(f"check {name!r} unknown; choose from {', '.join(CHECKS)}")
    return CHECKS[name]


def draw_case(
    data: st.DataObject, profile: Profile, backend: Backend, prepare: Callable[[Case, Backend], Case] = unchanged
) -> Case:
    """A case of ``profile`` moved into ``backend``'s envelope, prepared for the check."""
    fit = functools.partial(guard.fit, backend)
    return data.draw(cases(profile).map(fit).map(lambda case: prepare(case, backend)), label="case")


def supported(backend: Backend, case: Case) -> None:
    """Outside the backend's envelope there is nothing to check for this example (not a failure)."""
    assume(bool(guard.supports(backend, case)))


def run_check(
    check: Check, case: Case, backend: Backend, device: torch.device, params: Mapping[str, object] | None = None
) -> list[Finding]:
    """``check`` on ``case`` (prepared for it) with ``params``, outside any Hypothesis test: what a repro
    line reruns."""
    prepared = check.prepare(case, backend)
    judge = judge_for(check.name, prepared, backend.name, device, params)
    return blamed(judge, device, lambda: check.run(case_truth(prepared, device), backend, dict(params or {})))
