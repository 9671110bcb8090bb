"""Every finding names who is at fault: the backend under test, the suite (with its stage) or the machine
(``resource``: running out of memory in any form, in any stage). Multi-step checks judge each step against
its own truth. Rows are recorded once; Hypothesis is never handed a figure it refuses."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable

import pytest
import torch
from suite_paths import import_plugin

from kda_cases.case import Case
from kda_conformance.checks import CHECKS, Drawn, get_check, run_check
from kda_conformance.checks._tests import finite_or_largest
from kda_conformance.judging.repro import BUDGET_CHECK
from kda_conformance.running import faults, truth
from kda_conformance.running.config import build_config
from kda_conformance.running.faults import DeviceLost, memory_report
from kda_conformance.running.run import Run
from kda_kernels import registry
from kda_kernels.torch_chunk import TorchChunk
from kda_reports.findings import SUITE_BACKEND

CPU = torch.device("cpu")
CASE = Case(seq_lens=(20, 0, 13), packed=True, num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)


class Raises(TorchChunk):
    """The baseline, but its call raises what the test puts in ``Raises.error``."""

    name = "test_raises"
    error: BaseException = RuntimeError()

    def run(self, inputs):
        raise Raises.error


class NanCheckpoints(TorchChunk):
    name = "test_nan_checkpoints"
    produces_checkpoints = True

    def run(self, inputs):
        out = super().run(inputs)
        return dataclasses.replace(out, checkpoint_states=torch.full_like(out.checkpoint_states, math.nan))


class NoFinalState(TorchChunk):
    name = "test_no_final_state"
    envelope = dataclasses.replace(TorchChunk.envelope, host_metadata=("cu_seqlens_cpu",))  # the check runs too

    def host_metadata(self, device, cu_seqlens_cpu):
        return {"cu_seqlens_cpu": cu_seqlens_cpu.long()}

    def run(self, inputs):
        return dataclasses.replace(super().run(inputs), final_state=None)


@pytest.fixture(autouse=True)
def registered() -> None:
    for backend in (Raises, NanCheckpoints, NoFinalState):
        registry.register(backend.name, backend, replace=True)


def checked(run: Run, backend: str = "torch_chunk", case: Case = CASE) -> list:
    chosen = registry.get(backend)
    return run.checked(get_check(BUDGET_CHECK), Drawn(case), chosen)


@pytest.fixture
def run(tmp_path) -> Run:
    return Run(build_config(device="cpu", out=tmp_path), journal=False)


OOM_FORMS: list[Callable[[], BaseException]] = [
    lambda: torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    lambda: torch.AcceleratorError("CUDA error: out of memory"),
    lambda: RuntimeError("HIP error: hipErrorOutOfMemory"),
    lambda: RuntimeError("CUDA error: cudaErrorMemoryAllocation"),
    lambda: RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
]


@pytest.mark.parametrize("form", range(len(OOM_FORMS)))
@pytest.mark.parametrize("stage", ["materialize", "reference", "baseline", "backend"])
def test_out_of_memory_in_any_form_and_stage_is_the_machines(
    run: Run, stage: str, form: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    def raise_it(*args, **kwargs):
        raise OOM_FORMS[form]()

    if stage == "materialize":
        monkeypatch.setattr(truth, "materialize", raise_it)
    elif stage == "reference":
        monkeypatch.setattr(truth, "run_reference", raise_it)
    elif stage == "baseline":
        monkeypatch.setattr(truth, "run_backend_call", raise_it)
    else:
        Raises.error = OOM_FORMS[form]()
    [finding] = checked(run, "test_raises" if stage == "backend" else "torch_chunk")
    assert finding.verdict == "resource" and not finding.failed, finding
    assert "(alone on the device)" in finding.reason
    assert stage == "backend" or f"in the {stage} stage" in finding.reason


def test_the_memory_report_survives_a_device_that_cannot_be_queried(monkeypatch: pytest.MonkeyPatch) -> None:
    def dead(*args):
        raise torch.AcceleratorError("CUDA error: out of memory")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", dead)
    report = memory_report(torch.AcceleratorError("CUDA error: out of memory"), torch.device("cuda"))
    assert report.startswith("out of memory") and "could not be queried" in report


def test_the_suites_own_error_names_the_suite_and_its_stage(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args, **kwargs):
        raise ValueError("a bug of the suite's")

    monkeypatch.setattr(truth, "run_reference", broken)
    [finding] = checked(run)
    assert finding.backend == SUITE_BACKEND and finding.verdict == "error"
    assert "the suite's own code raised in the reference stage (not torch_chunk's error)" in finding.reason


def test_a_backends_exception_is_its_own_and_a_sticky_one_ends_the_process(run: Run) -> None:
    Raises.error = KeyError("no such kernel")
    [finding] = checked(run, "test_raises")
    assert finding.backend == "test_raises" and finding.verdict == "error" and "KeyError" in finding.reason
    Raises.error = RuntimeError("CUDA error: misaligned address")
    with pytest.raises(DeviceLost) as lost:
        checked(run, "test_raises")
    assert [f.backend for f in lost.value.findings] == ["test_raises"]
    assert faults.is_sticky(lost.value.findings[0].reason)


def test_a_replayed_example_is_recorded_once(run: Run) -> None:
    findings = checked(run)
    first, again = run.record(findings, "node"), run.record(findings, "node")
    assert len(first) == len(findings) and again == []


def test_hypothesis_is_handed_finite_figures_only() -> None:
    assert finite_or_largest(0.5) == 0.5
    assert finite_or_largest(math.inf) == finite_or_largest(math.nan) == sys.float_info.max


def test_split_resume_judges_the_prefix_against_its_own_truth_first() -> None:
    import_plugin("kda_hostile")  # registers the backends
    case = Case(seq_lens=(40,), num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    findings = run_check(
        get_check("split_resume"), case, registry.get("hostile_nan_state_at_step_one"), CPU, {"at": 17}
    )
    assert findings and all("step 1" in f.subject for f in findings)
    assert [f.tensor for f in findings if f.failed] == ["final_state"]


def test_a_wrong_checkpoint_is_judged_at_the_batch_and_no_request_resumes_from_it() -> None:
    case = CASE.replace(checkpoints=((0, 16),), initial_state="random")
    findings = run_check(get_check("checkpoint"), case, registry.get("test_nan_checkpoints"), CPU)
    assert [f.tensor for f in findings] == ["checkpoint_states"] and findings[0].failed
    assert "non-finite" in findings[0].problems[0] and findings[0].backend == "test_nan_checkpoints"


def test_a_backend_that_returns_no_final_state_is_at_fault_in_every_check(run: Run) -> None:
    """Packing and host_metadata indexed the missing state and charged the suite a TypeError."""
    backend = registry.get(NoFinalState.name)
    case = Case(seq_lens=(20, 17), packed=True, initial_state="random", num_heads=1, num_v_heads=1, head_k_dim=16,
                head_v_dim=16)  # fmt: skip
    for name, check in CHECKS.items():
        if check.applies(backend, "cpu"):
            continue
        params = {p.name: {"at": 5, "poison": "nan"}[p.name] for p in check.params}
        findings = run_check(check, case, backend, CPU, params, run)
        assert all(f.backend != SUITE_BACKEND for f in findings), (name, [f.reason for f in findings])
        if name == "packing":
            assert any(f.errors and f.errors.detail == "backend returned no tensor" for f in findings), findings
