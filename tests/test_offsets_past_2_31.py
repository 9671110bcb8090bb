"""Offsets past 2^31 (conformance/checks/offsets_past_2_31.py), on the CPU with the threshold lowered to 2^12
elements: the case's sequences packed behind a filler of zero tokens are judged where they land, a kernel whose
offsets wrap past the threshold is caught, the baseline passes, and a batch that would not fit is a skip."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kda_cases.case import Case
from kda_conformance.checks import get_check, run_check
from kda_conformance.checks import offsets_past_2_31 as offsets
from kda_conformance.running.config import build_config
from kda_conformance.running.faults import DeviceLost
from kda_conformance.running.run import Run
from kda_kernels import registry
from kda_kernels.protocol import BackendOutput
from kda_kernels.torch_chunk import TorchChunk

SCRATCH_PROBE = Path(__file__).with_name("scratch_probe.py")
H200 = 139.8 * 2**30

CPU = torch.device("cpu")
LOW = 2**12


class WrapsPastThreshold(TorchChunk):
    """The baseline, but a sequence that starts past LOW elements of q reads q from its offset wrapped modulo
    LOW tokens' worth, as a 32-bit offset wraps past 2^31."""

    name = "test_wraps_past_threshold"

    def run(self, inputs):
        case = inputs.case
        per_token = case.num_heads * case.head_k_dim
        if case.packed and inputs.cu_seqlens is not None:
            q = inputs.q.clone()
            for start, end in zip(case.offsets[:-1], case.offsets[1:], strict=True):
                if start * per_token >= LOW and end > start:
                    wrapped = (start * per_token) % LOW // per_token
                    q[:, start:end] = inputs.q[:, wrapped : wrapped + end - start]
            inputs = dataclasses.replace(inputs, q=q)
        out = super().run(inputs)
        return BackendOutput(o=out.o, final_state=out.final_state)


class WrongBehindAnyFiller(TorchChunk):
    """The baseline, but its outputs are off by one wherever the batch starts with a sequence of zero tokens,
    however short: a packing bug, not an offset."""

    name = "test_wrong_behind_any_filler"

    def run(self, inputs):
        out = super().run(inputs)
        first = inputs.case.seq_lens[0]
        if inputs.case.packed and len(inputs.case.seq_lens) > 1 and first and not inputs.q[:, :first].any():
            return BackendOutput(o=out.o + 1, final_state=out.final_state)
        return out


class LosesTheDeviceBehindAShortFiller(WrapsPastThreshold):
    """Wraps past the threshold, and its call behind a short filler (the control) kills the device."""

    name = "test_loses_the_device_behind_a_short_filler"

    def run(self, inputs):
        if inputs.case.packed and inputs.case.seq_lens[0] * inputs.case.num_heads * inputs.case.head_k_dim < LOW:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().run(inputs)


@pytest.fixture
def check(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(offsets, "THRESHOLD", LOW)
    registry.register(WrapsPastThreshold.name, WrapsPastThreshold, replace=True)
    registry.register(WrongBehindAnyFiller.name, WrongBehindAnyFiller, replace=True)
    registry.register(LosesTheDeviceBehindAShortFiller.name, LosesTheDeviceBehindAShortFiller, replace=True)
    return dataclasses.replace(get_check("offsets_past_2_31"), devices=("cpu", "cuda"))


def test_sequences_past_the_threshold_are_judged_where_they_land(check, tmp_path) -> None:
    assert get_check("offsets_past_2_31").applies(registry.get("torch_chunk"), "cpu"), "a GPU check"
    case = Case(seq_lens=(20, 17), packed=True, initial_state="random", num_heads=2, num_v_heads=2, head_k_dim=16,
                head_v_dim=16)  # fmt: skip
    assert offsets.filler_tokens(case) == LOW // 32 + 1  # past LOW elements of q (and of v)
    run = Run(build_config(device="cpu", out=tmp_path), journal=False)
    baseline = run_check(check, case, registry.get("torch_chunk"), CPU, {}, run)
    assert baseline and not any(f.failed for f in baseline), [f.message() for f in baseline if f.failed]
    assert {f.subject for f in baseline} == {f"behind {LOW // 32 + 1} tokens of filler (past {LOW} elements)"}
    wrapped = run_check(check, case, registry.get(WrapsPastThreshold.name), CPU, {}, run)
    assert any(f.failed and f.tensor == "o" for f in wrapped)
    # Its control, the case behind a filler under LOW / 8 elements in every tensor, passes: the size is the cause.
    control = f"behind {offsets.control_filler_tokens(case)} tokens of filler (the control"
    assert all(control in f.problems[-1] and "the failure comes with the size" in f.problems[-1]
               for f in wrapped if f.failed), [f.problems for f in wrapped]  # fmt: skip
    # A [B, T] case runs as its packed form.
    flat = Case(seq_lens=(30, 30), num_heads=2, num_v_heads=2, head_k_dim=16, head_v_dim=16)
    assert not any(f.failed for f in run_check(check, flat, registry.get("torch_chunk"), CPU, {}, run))


def test_a_failure_its_control_repeats_is_not_put_down_to_the_size(check, tmp_path) -> None:
    """The same case behind a short filler fails too: the finding says the size is not the cause."""
    case = Case(seq_lens=(20, 17), packed=True, num_heads=2, num_v_heads=2, head_k_dim=16, head_v_dim=16)
    run = Run(build_config(device="cpu", out=tmp_path), journal=False)
    findings = run_check(check, case, registry.get(WrongBehindAnyFiller.name), CPU, {}, run)
    failed = [f for f in findings if f.failed]
    assert failed and all("it fails too" in f.problems[-1] and "not the size" in f.problems[-1] for f in failed)
    # A kernel that passes behind the threshold's filler is never run again.
    assert not any(
        "the control" in " ".join(f.problems) for f in run_check(check, case, registry.get("torch_chunk"), CPU, {}, run)
    )


def test_a_control_that_loses_the_device_is_the_backends_error_and_ends_the_process(check, tmp_path) -> None:
    case = Case(seq_lens=(20, 17), packed=True, num_heads=2, num_v_heads=2, head_k_dim=16, head_v_dim=16)
    run = Run(build_config(device="cpu", out=tmp_path), journal=False)
    with pytest.raises(DeviceLost) as lost:
        run_check(check, case, registry.get(LosesTheDeviceBehindAShortFiller.name), CPU, {}, run)
    [error] = lost.value.findings
    assert error.verdict == "error" and "illegal memory access" in error.reason, error


def test_the_control_keeps_every_tensor_and_a_chunk_kernels_states_under_its_share() -> None:
    """At H16 K = V = 128 a chunk kernel's states (H x K x V per 64 tokens) are the widest: 4,096 elements a token,
    so the control's 2^28 elements allow 65,536 tokens with the case's 300."""
    wide = Case(seq_lens=(300,), num_heads=16, num_v_heads=16, head_k_dim=128, head_v_dim=128)
    assert offsets.control_filler_tokens(wide) == 2**31 // 8 // 4096 - 300
    narrow = Case(seq_lens=(300,), num_heads=9, num_v_heads=9, head_k_dim=32, head_v_dim=64)  # v is the widest
    assert offsets.control_filler_tokens(narrow) == 2**31 // 8 // (9 * 64) - 300
    # A kernel of 16-token chunks (FlashKDA's) keeps four times the states a token: a control a quarter as long.
    assert offsets.control_filler_tokens(wide, chunk_tokens=16) == 2**31 // 8 // (4 * 4096) - 300


def test_a_batch_that_would_not_fit_the_device_is_a_skip_saying_how_much(check, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(offsets, "device_memory", lambda device: 2**10)  # the batch takes about 60 KiB
    case = Case(seq_lens=(40,), num_heads=2, num_v_heads=2, head_k_dim=16, head_v_dim=16)
    run = Run(build_config(device="cpu", out=tmp_path), journal=False)
    [skipped] = run_check(check, case, registry.get("torch_chunk"), CPU, {}, run)
    assert skipped.verdict == "skip" and "needs about" in skipped.reason and "GiB" in skipped.reason, skipped


class AllocatesAMegabyteAToken(TorchChunk):
    """The baseline, declaring that its call allocates a MiB per token beyond its tensors."""

    name = "test_allocates_a_megabyte_a_token"

    def scratch_bytes_per_token(self, case: Case) -> int:
        return 2**20


def test_the_plan_counts_what_the_backend_allocates(check, tmp_path, monkeypatch) -> None:
    """A batch whose tensors fit (about 60 KiB of 1 MiB) but whose backend's own allocations do not is a skip
    (its head dims raised to 64, which plans less with a MiB a token: 33 tokens of filler instead of 129)."""
    monkeypatch.setattr(offsets, "device_memory", lambda device: 2**20)
    case = Case(seq_lens=(40,), num_heads=2, num_v_heads=2, head_k_dim=16, head_v_dim=16)
    run = Run(build_config(device="cpu", out=tmp_path), journal=False)
    assert all(f.verdict == "pass" for f in run_check(check, case, registry.get("torch_chunk"), CPU, {}, run))
    [skipped] = run_check(check, case, AllocatesAMegabyteAToken(), CPU, {}, run)
    assert skipped.verdict == "skip" and "behind 33 tokens of filler needs about 0.1 GiB" in skipped.reason, skipped


def test_a_case_too_narrow_to_reach_the_threshold_gets_more_heads(check, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(offsets, "MAX_FILLER_TOKENS", 64)
    case = Case(seq_lens=(40,), num_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16)  # 257 tokens of filler
    backend = registry.get("torch_chunk")
    wide = check.prepare(case, backend)
    assert (wide.num_heads, wide.num_v_heads, wide.packed) == (6, 6, True)  # 43 tokens of filler, equal heads
    assert check.prepare(wide, backend) == wide
    run = Run(build_config(device="cpu", out=tmp_path), journal=False)
    found = run_check(check, case, backend, CPU, {}, run)
    assert found and all(f.verdict == "pass" for f in found), found


def test_grouped_value_heads_become_equal_heads_with_half_the_filler() -> None:
    """On the H100 every 2^31 draw of FLA's chunk kernel was skipped: at H4/8 K = V = 128 the batch planned
    88.3 GiB, past 80 % of the card's 79.2 GiB. Prepared, the same draw has 8 query heads and half the filler,
    and its tensors and states plan 52.2 GiB in bf16. FLA's chunk kernel allocates more than those (it ran out
    of an H100's memory at 80.6 GiB, the results journal's fifteenth session): with its own allocations the
    batch plans 92.1 GiB, a skip on an H100 that says so, a run on an H200."""
    h100 = 79.2 * 2**30
    drawn = Case(seq_lens=(64,), num_heads=4, num_v_heads=8, head_k_dim=128, head_v_dim=128, dtype="bf16")
    assert offsets.planned_bytes(drawn.replace(packed=True), offsets.filler_tokens(drawn)) / 2**30 == pytest.approx(
        88.3, abs=0.1
    )
    ready = offsets.prepare(drawn, registry.get("torch_chunk"))
    assert (ready.num_heads, ready.num_v_heads) == (8, 8)
    assert offsets.filler_tokens(ready) == 2097153  # half of the drawn case's 4194305
    assert offsets.planned_bytes(ready, offsets.filler_tokens(ready)) < offsets.MEMORY_SHARE * h100
    fp32 = ready.replace(dtype="fp32")
    assert offsets.planned_bytes(fp32, offsets.filler_tokens(fp32)) > offsets.MEMORY_SHARE * h100
    fla = registry.get("fla_chunk").scratch_bytes_per_token(ready)
    fla_plan = offsets.planned_bytes(ready, offsets.filler_tokens(ready), fla)
    assert fla_plan / 2**30 == pytest.approx(92.1, abs=0.1)
    assert offsets.MEMORY_SHARE * h100 < fla_plan < offsets.MEMORY_SHARE * H200


class DeclaresFlaAllocations(TorchChunk):
    """The baseline, declaring FLA's chunk kernel's own allocations per token (8(K + V) + 512 bytes a head)."""

    name = "test_declares_fla_allocations"

    def scratch_bytes_per_token(self, case: Case) -> int:
        return registry.get("fla_chunk").scratch_bytes_per_token(case)


class TakesOnlyHeadDim32(DeclaresFlaAllocations):
    name = "test_takes_only_head_dim_32"
    envelope = dataclasses.replace(TorchChunk.envelope, head_dims=(32,))


def test_narrow_head_dims_are_raised_where_that_plans_less_memory() -> None:
    """At H9/9 K32 V64 bf16 FLA's chunk kernel's allocations planned 136.5 GiB (a skip even on an H200): its
    allocations per token and head do not shrink with the head dims, and narrow heads need a long filler. With K
    and V at 64 the batch plans 92.3 GiB. Where the backend allocates nothing of its own, the narrow case plans
    less and is kept; a head dim outside the backend's envelope is never chosen."""
    drawn = Case(seq_lens=(300,), num_heads=9, num_v_heads=9, head_k_dim=32, head_v_dim=64, dtype="bf16")

    def plan(case: Case, backend) -> float:
        return offsets.planned_bytes(case, offsets.filler_tokens(case), backend.scratch_bytes_per_token(case)) / 2**30

    fla_like = DeclaresFlaAllocations()
    assert plan(drawn.replace(packed=True), fla_like) == pytest.approx(136.5, abs=0.1)
    ready = offsets.prepare(drawn, fla_like)
    assert (ready.head_k_dim, ready.head_v_dim) == (64, 64)
    assert (
        plan(ready, fla_like) == pytest.approx(92.3, abs=0.1) and plan(ready, fla_like) < offsets.MEMORY_SHARE * 139.8
    )
    assert offsets.prepare(ready, fla_like) == ready
    uneven = offsets.prepare(drawn.replace(head_k_dim=64, head_v_dim=128), fla_like)
    assert (uneven.head_k_dim, uneven.head_v_dim) == (128, 128)  # 128.3 GiB as drawn, 92.1 at K = V = 128
    plain = offsets.prepare(drawn, registry.get("torch_chunk"))  # 56.5 GiB as drawn, 44.3 at 64: both fit; the cheaper
    assert (plain.head_k_dim, plain.head_v_dim) == (64, 64)
    narrow = Case(seq_lens=(300,), num_heads=9, num_v_heads=9, head_k_dim=32, head_v_dim=32, dtype="bf16")
    assert offsets.prepare(narrow, registry.get("torch_chunk")) == narrow.replace(packed=True)  # its states grow more
    only32 = offsets.prepare(narrow, TakesOnlyHeadDim32())
    assert (only32.head_k_dim, only32.head_v_dim) == (32, 32)


@pytest.mark.slow
def test_the_plan_holds_what_fla_chunk_forward_allocates() -> None:
    """The plan's share of FLA's chunk kernel (its own allocations and a float32 state per 64 tokens) is at
    least what the kernel allocates per token and head, measured in the interpreter, and not far above it."""
    pytest.importorskip("fla")
    done = subprocess.run(
        [sys.executable, str(SCRATCH_PROBE), "64", "64"], capture_output=True, text=True, timeout=600, check=True
    )
    measured = json.loads(done.stdout.strip().splitlines()[-1])["bytes_per_token_head"]
    case = Case(seq_lens=(512,), num_heads=1, num_v_heads=1, head_k_dim=64, head_v_dim=64)
    planned = registry.get("fla_chunk").scratch_bytes_per_token(case) + 64 * 64 * 4 / 64
    assert measured <= planned <= 1.25 * measured, (measured, planned)
