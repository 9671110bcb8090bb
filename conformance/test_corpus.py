"""The committed corpus (cases/corpus/*.json) against every selected backend, in every profile; the run's
long cases (the nightly and long profiles: 128K tokens in each dtype, new each night), its guaranteed cases
(the nightly profile: every required axis value, new each night) and the sentinels (the same every night):
the budget check on each. The run's long backward cases (32K tokens, new each night): the gradients check on
each, with the backends that declare a backward pass."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kda_cases.case import Case
from kda_cases.corpus import CorpusEntry, load_corpus
from kda_conformance.checks import CHECKS, Drawn
from kda_conformance.checks._tests import fail, fitted_or_unanswered, unanswered
from kda_conformance.checks.gradients import NAME as GRADIENTS
from kda_conformance.judging.judge import judge_for
from kda_conformance.judging.repro import BUDGET_CHECK
from kda_conformance.running.run import Run
from kda_conformance.running.sweep import fit_or_fault
from kda_kernels import guard
from kda_kernels.guard import BackendFault
from kda_kernels.protocol import Backend, Support
from kda_reports.findings import failure_report

ENTRIES = load_corpus()
CORPUS = "corpus"  # how the run's example log names these tests


@pytest.mark.kda_device_dependent
@pytest.mark.parametrize("entry", ENTRIES, ids=[e.case.test_id for e in ENTRIES])
def test_corpus_case(
    entry: CorpusEntry, kda_backend: Backend, kda_run: Run, kda_checked: Callable, request: pytest.FixtureRequest
) -> None:
    case, backend = entry.case, kda_backend
    assert kda_run.config.profile is not None
    too_large = kda_run.config.profile.corpus_skip(case, backend.interpreted(kda_run.config.device))
    if too_large:
        pytest.skip(too_large)
    findings = kda_checked(CHECKS[BUDGET_CHECK], Drawn(case), backend)
    skipped = [f for f in findings if f.verdict in ("skip", "resource")]
    if skipped and len(skipped) == len(findings):  # (a skip of one tensor beside judged ones is recorded)
        pytest.skip(f"{backend.name}: {skipped[0].verdict}: {skipped[0].reason}")
    report = failure_report(findings, f"pinned because: {entry.why}")
    nodeid = request.node.nodeid
    kda_run.examples.open(nodeid, CORPUS, backend.name)
    kda_run.examples.ran_once(nodeid, failed=report is not None)
    if report:
        kda_run.examples.keep_failure(nodeid, [f.to_dict() for f in findings if f.failed])
        fail(request, findings, report)


@pytest.mark.kda_device_dependent
def test_long_case(
    long_case: Case,
    kda_backend: Backend,
    kda_run: Run,
    kda_checked: Callable,
    kda_record: Callable,
    request: pytest.FixtureRequest,
) -> None:
    """A long case of the run (moved into the backend's envelope), within its budgets."""
    fitted = fitted_or_unanswered(BUDGET_CHECK, long_case, kda_backend, kda_run, kda_record)
    _within_budget(fitted, kda_backend, kda_run, kda_checked, "long case of the run", request, kda_record)


@pytest.mark.kda_device_dependent
def test_long_backward(
    long_backward_case: Case,
    kda_backend: Backend,
    kda_run: Run,
    kda_checked: Callable,
    kda_record: Callable,
    request: pytest.FixtureRequest,
) -> None:
    """A long backward case of the run (moved into the backend's envelope) through the gradients check: each
    gradient within its budget, the sequences alone, the same bits again and with poisoned scratch. Only
    backends that declare a backward pass are given one."""
    fitted = fitted_or_unanswered(GRADIENTS, long_backward_case, kda_backend, kda_run, kda_record)
    prepared = CHECKS[GRADIENTS].prepare(fitted, kda_backend)
    what = "long backward case of the run"
    _within_budget(prepared, kda_backend, kda_run, kda_checked, what, request, kda_record, GRADIENTS)


@pytest.mark.kda_device_dependent
def test_guaranteed_case(
    guaranteed_case: Case,
    kda_backend: Backend,
    kda_run: Run,
    kda_checked: Callable,
    kda_record: Callable,
    request: pytest.FixtureRequest,
) -> None:
    """A guaranteed case of the night (cases/guarantee.py: together they reach every required axis value,
    whatever the seed), within its budgets. A backend that does not take it records that skip (the night's
    coverage then tells a value outside its envelope from one the night missed) and runs the case moved
    into its envelope instead."""
    fitted, fault = fit_or_fault(kda_backend, guaranteed_case)
    if fault is None:
        try:
            outside = not guard.supports(kda_backend, guaranteed_case)
        except BackendFault as raised:
            fault = raised
    if fault is not None:
        unanswered(BUDGET_CHECK, kda_backend, kda_run, kda_record, fault)
    if outside:
        _skip_record(guaranteed_case, kda_backend, kda_run, kda_record)
    what = "guaranteed case of the night" + (", moved into the backend's envelope" if outside else "")
    _within_budget(fitted, kda_backend, kda_run, kda_checked, what, request, kda_record)


@pytest.mark.kda_device_dependent
def test_sentinel(
    sentinel: Case,
    kda_backend: Backend,
    kda_run: Run,
    kda_checked: Callable,
    kda_record: Callable,
    request: pytest.FixtureRequest,
) -> None:
    """A sentinel (cases/sentinels.json: the same inputs every night, each with its own error history,
    whose growth reports/regressions.py flags), within its budgets."""
    _within_budget(sentinel, kda_backend, kda_run, kda_checked, "sentinel", request, kda_record)


def _within_budget(
    case: Case,
    backend: Backend,
    kda_run: Run,
    kda_checked: Callable,
    what: str,
    request: pytest.FixtureRequest,
    kda_record: Callable,
    check: str = BUDGET_CHECK,
) -> None:
    """``check`` (the budget check unless named) on ``case``: a failure fails the test, a case the backend does
    not take is recorded as such and skipped."""
    try:
        supported = guard.supports(backend, case)
    except BackendFault:  # the check asks again, and records the backend's error
        supported = Support.yes()
    if not supported:
        _skip_record(case, backend, kda_run, kda_record, check)
        pytest.skip(f"{backend.name}: {supported.reason}")
    findings = kda_checked(CHECKS[check], Drawn(case), backend)
    skipped = [f for f in findings if f.verdict in ("skip", "resource")]
    if skipped and len(skipped) == len(findings):  # (a skip of one tensor beside judged ones is recorded)
        pytest.skip(f"{backend.name}: {skipped[0].verdict}: {skipped[0].reason}")
    report = failure_report(findings, f"{what} ({case.total_tokens} tokens)", kda_run.config.fails)
    if report:
        fail(request, findings, report)


def _skip_record(case: Case, backend: Backend, kda_run: Run, kda_record: Callable, check: str = BUDGET_CHECK) -> None:
    """The case recorded as outside the backend's envelope, without computing its truth: the night's coverage
    per backend tells a value outside the envelope from one the night missed (reports/reach.py)."""
    reason = guard.supports(backend, case).reason
    kda_record([judge_for(check, case, backend.name, kda_run.config.device).outcome("skip", reason)])
