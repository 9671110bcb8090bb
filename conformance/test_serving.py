"""Every selected backend served the way a server runs it (kda_kernels.serving), on cases drawn for the profile.

Poisoned pool slots, output rows and scratch memory must not change the answer; slots nobody names and
rows past the tokens must stay untouched; a two-step prefill, a request resumed from a checkpoint slot and
a reused ``cu_seqlens`` tensor must give the whole run's answer. A failure says where, and prints the
``kda-conformance repro`` line that rebuilds it.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kda_cases.strategies import cases
from kda_conformance.serving import (
    checkpoint_resume_findings,
    poison_findings,
    repro_line,
    reused_cu_seqlens_findings,
    serving_case,
    steps_findings,
)
from kda_kernels.serving import POISON_MODES

pytestmark = pytest.mark.kda_device_dependent


def _served(backend, kda_profile, kda_device, kda_truth, data, wanted=lambda case: True):  # type: ignore[no-untyped-def]
    case = serving_case(data.draw(cases(kda_profile).map(backend.fit), label="case"), backend)
    assume(wanted(case))
    assume(bool(backend.supports(case)))
    return case, backend, kda_truth(case, kda_device)


def _message(case, backend: str, device, findings: list[str], poison: str, check: str) -> str | None:  # type: ignore[no-untyped-def]
    if not findings:
        return None
    return (
        f"{case.id} ({case.label}) backend {backend}, served ({check}):\n  "
        + "\n  ".join(findings)
        + f"\n  repro: {repro_line(case, backend, device, poison, check)}"
    )


@given(data=st.data())
def test_poisoned_memory_changes_nothing(kda_backend, kda_profile, kda_device, kda_truth, kda_check, data) -> None:  # type: ignore[no-untyped-def]
    """Poison in slot 0, fresh sequences' slots, checkpoint and spare slots, the output tail and scratch."""
    case, backend, truth = _served(kda_backend, kda_profile, kda_device, kda_truth, data)
    poison = data.draw(st.sampled_from([m for m in POISON_MODES if m != "none"]), label="poison")
    findings = poison_findings(truth, backend, poison)
    kda_check(_message(case, backend.name, kda_device, findings, poison, "poison"))


@given(data=st.data())
def test_two_step_prefill_equals_whole_run(kda_backend, kda_profile, kda_device, kda_truth, kda_check, data) -> None:  # type: ignore[no-untyped-def]
    case, backend, truth = _served(kda_backend, kda_profile, kda_device, kda_truth, data, lambda c: c.max_len >= 2)
    kda_check(_message(case, backend.name, kda_device, steps_findings(truth, backend), "nan", "steps"))


@given(data=st.data())
def test_request_resumes_from_checkpoint_slot(kda_backend, kda_profile, kda_device, kda_truth, kda_check, data) -> None:  # type: ignore[no-untyped-def]
    if not kda_backend.produces_checkpoints:
        pytest.skip(f"{kda_backend.name} returns no checkpoint states")
    case, backend, truth = _served(
        kda_backend,
        kda_profile,
        kda_device,
        kda_truth,
        data,
        lambda c: any(c.seq_lens[s] > p for s, p in c.checkpoints),
    )
    findings = checkpoint_resume_findings(truth, backend)
    kda_check(_message(case, backend.name, kda_device, findings, "nan", "checkpoint"))


@given(data=st.data())
def test_reused_cu_seqlens_tensor_gets_new_bounds(
    kda_backend, kda_profile, kda_device, kda_truth, kda_check, data
) -> None:  # type: ignore[no-untyped-def]
    case, backend, truth = _served(kda_backend, kda_profile, kda_device, kda_truth, data)
    findings = reused_cu_seqlens_findings(truth, backend)
    kda_check(_message(case, backend.name, kda_device, findings, "none", "cu_seqlens"))
