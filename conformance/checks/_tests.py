"""pytest tests made from the check registry: one Hypothesis test per registered check, run for every
selected backend. ``conformance/test_properties.py`` and ``test_serving.py`` hold the tests of their suite."""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable
from typing import NoReturn

import pytest
from hypothesis import event, given, reject, target
from hypothesis import strategies as st
from hypothesis.errors import FailedHealthCheck, Unsatisfiable

from kda_cases.case import Case
from kda_cases.coverage import axis_values
from kda_conformance.checks._check import Check
from kda_conformance.checks._registry import CHECKS, REFUSALS
from kda_conformance.judging.judge import judge_for
from kda_conformance.running.blame import NOT_APPLICABLE, fault_finding
from kda_conformance.running.hypothesis_settings import seed_check_test
from kda_conformance.running.run import NOT_LAUNCHED, Run
from kda_conformance.running.sweep import fit_or_fault
from kda_kernels.guard import BackendFault
from kda_kernels.protocol import Backend
from kda_reports.findings import Finding, failure_report


def check_report(check: Check, findings: list[Finding], params: dict, fails: Callable[[Finding], bool]) -> str | None:
    """The failure message of one example of ``check`` (None when it passed): the findings the run counts
    as failures (``fails``). The backend took the case (the draw made sure), so a skip of the whole call here
    means it raised Unsupported anyway: a failure too. A skip of one tensor (checkpoint states a backend does
    not return), and a case a quarantine kept from launching (its configuration not compiled tonight), are
    recorded, not failed."""
    whole = [f for f in findings if f.verdict == "skip" and not f.tensor and f.observed != NOT_LAUNCHED]
    bad = [f if f.verdict != "skip" else _as_failure(f) for f in findings if fails(f) or f in whole]
    if not bad:
        return None
    case, backend = bad[0].case, bad[0].backend
    drawn = "".join(f", {name} {value}" for name, value in params.items())
    header = f"{check.title}{drawn}: {case.id} ({case.label}) backend {backend}"
    return failure_report(bad, header, failing=lambda f: True)


def _as_failure(skipped: Finding) -> Finding:
    return dataclasses.replace(skipped, verdict="error", reason=f"raised Unsupported: {skipped.reason}")


def unanswered(check: str, backend: Backend, run: Run, record: Callable, fault: BackendFault) -> NoReturn:
    """Record and fail the error of a backend whose ``fit`` or ``supports`` raised on a case (the fault
    names the case) instead of answering."""
    case = getattr(fault, "case", None)
    if case is None:
        raise fault
    findings = [fault_finding(judge_for(check, case, backend.name, run.config.device), fault)]
    record(findings)
    pytest.fail(failure_report(findings) or "", pytrace=False)


def fitted_or_unanswered(check: str, case: Case, backend: Backend, run: Run, record: Callable) -> Case:
    """``case`` moved into the backend's envelope; a backend whose ``fit`` raised has its error recorded under
    ``check`` and the test failed (:func:`unanswered`)."""
    fitted, fault = fit_or_fault(backend, case)
    if fault is not None:
        unanswered(check, backend, run, record, fault)
    return fitted


def fail(request: pytest.FixtureRequest, findings: list[Finding], report: str) -> NoReturn:
    """Fail the test with ``report`` (said once, no traceback: the findings, their ratios to the limits, the
    first bad point, the repro line), and give a CI's test report (JUnit XML) the first failure's case,
    backend, check, worst error/limit and repro line as properties."""
    failed = next((f for f in findings if f.failed), None)
    if failed is not None:
        properties = {
            "kda_case_id": failed.case.id,
            "kda_backend": failed.backend,
            "kda_check": failed.check,
            "kda_worst_ratio": f"{failed.worst:.4g}",
            "kda_repro": failed.repro,
        }
        request.node.user_properties.extend(properties.items())
    pytest.fail(report, pytrace=False)


def finite_or_largest(x: float) -> float:
    """``x`` where it is a finite number; the largest finite float where it is NaN or infinite."""
    return x if math.isfinite(x) else sys.float_info.max


def check_test(check: Check) -> Callable[..., None]:
    """The pytest test of ``check``: draw a case for the backend, run the check on its truth, fail with the
    findings' message and repro line."""
    # Hypothesis runs a failing example once more at the end. A kernel whose wrong answer does not repeat
    # (garbage read from memory it should not touch) can pass that rerun, which Hypothesis reports as its
    # own FlakyFailure in place of the suite's report: the rerun of a failed example gets its first verdict.
    failed: dict[tuple, tuple[list[Finding], str]] = {}

    def body(
        kda_backend: Backend,
        kda_run: Run,
        kda_checked: Callable,
        kda_record: Callable,
        request: pytest.FixtureRequest,
        data,
    ) -> None:
        backend = kda_backend
        reason = check.applies(backend, kda_run.config.device.type)
        if reason:
            pytest.skip(reason)
        nodeid = request.node.nodeid
        kda_run.examples.open(nodeid, check.name, backend.name)
        assert kda_run.config.profile is not None
        profile = kda_run.config.profile.for_backend(backend.interpreted(kda_run.config.device))
        try:
            drawn = check.draw(data, profile, backend)
        except BackendFault as fault:  # its fit or supports raised on the drawn case: its error, recorded
            unanswered(check.name, backend, kda_run, kda_record, fault)
        for axis, values in axis_values(drawn.case).items():  # Hypothesis's statistics: the axes reached
            for value in values:
                event(f"{axis}: {value}")
        example = (backend.name, drawn.case.id, repr(sorted(drawn.params.items())))
        if example in failed:
            fail(request, *failed[example])
        findings = kda_checked(check, drawn, backend)
        if findings and all(f.observed == NOT_APPLICABLE for f in findings):
            # The check cannot run on this draw on this device (a batch past 2^31 elements that does not fit its
            # memory): recorded as a skip, and another example drawn.
            not_applied[backend.name] = findings[0].reason
            reject()
        measured = [f.worst for f in findings if f.errors is not None]
        if check.targets and profile.targeted and measured:
            # Climb toward the worst inputs: the largest error/limit ratio this backend shows (Hypothesis takes
            # finite figures only: a NaN or infinite error counts as the largest finite one).
            target(max(finite_or_largest(x) for x in measured), label=backend.name)
        # A case that did not fit the device's memory, even alone, is recorded as such: not the kernel's fault.
        report = check_report(check, findings, dict(drawn.params), kda_run.config.fails)
        if report:
            kda_run.examples.keep_failure(nodeid, [f.to_dict() for f in findings if not f.passed])
            failed[example] = (findings, report)
            fail(request, findings, report)

    not_applied: dict[str, str] = {}  # per backend, why the check did not apply to the last draw it rejected
    test = given(data=st.data())(body)  # its signature is the one pytest sees; it runs as ``search`` made it
    searching: list[Callable[..., None]] = []

    def search(seed: int | None) -> None:
        """The Hypothesis test that runs, made afresh: drawing from ``seed``, with the loaded profile's settings
        (made when the run configures, so that profile is their parent) and the check's own cap on examples.
        Hypothesis reads a test's seed and settings from the function ``given`` made, not from a wrapper of
        it: set on the wrapper pytest collects, as they once were, a nightly drew other cases on every run of
        one seed (the results journal, fifteenth session)."""
        searching[:] = [seed_check_test(given(data=st.data())(body), check.name, seed, check.max_examples)]

    @functools.wraps(test)
    def refusing_plugin_said(*args, **kwargs) -> None:
        if not searching:  # outside the suite's plugin: no seed, the profile's settings as they are now
            search(None)
        backend = kwargs.get("kda_backend")
        try:
            searching[0](*args, **kwargs)
            return
        except (FailedHealthCheck, Unsatisfiable):
            said = not_applied.get(backend.name) if isinstance(backend, Backend) else None
            if said is not None:
                pytest.skip(f"no case drawn for {backend.name} could run here; the last: {said}")
            refused = REFUSALS.get(backend.name) if isinstance(backend, Backend) else None
            if refused is None:
                raise
        pytest.fail(  # outside the handler: Hypothesis's own text would be chained above it
            f"{backend.name}: its supports() refused {refused[0]} of the cases drawn for it (the last: "
            f"{refused[1]}) and Hypothesis gave up: a configuration problem of the plugin, not a failure of its "
            "kernel. Declare the cases it takes as its Envelope (docs/plugins.md: `envelope = Envelope(dtypes=..., "
            "head_dims=...)`) and the suite draws inside it.",
            pytrace=False,
        )

    refusing_plugin_said.__name__ = refusing_plugin_said.__qualname__ = check.test_name
    refusing_plugin_said.__doc__ = check.summary
    refusing_plugin_said.kda_check = check
    refusing_plugin_said.kda_search = search
    return refusing_plugin_said


def suite_tests(suite: str) -> dict[str, Callable[..., None]]:
    """The tests of every registered check of ``suite``, by test name (for a test module's namespace)."""
    return {check.test_name: check_test(check) for check in CHECKS.values() if check.suite == suite}
