"""Offsets past 2^31 (conformance/checks/offsets_past_2_31.py), on the CPU with the threshold lowered to 2^12
elements: the case's sequences packed behind a filler of zero tokens are judged where they land, a kernel whose
offsets wrap past the threshold is caught, the baseline passes, and a batch that would not fit is a skip."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kda_cases.case import Case
from kda_conformance.checks import get_check, run_check
from kda_conformance.checks import offsets_past_2_31 as offsets
from kda_conformance.running.config import build_config
from kda_conformance.running.run import Run
from kda_kernels import registry
from kda_kernels.protocol import BackendOutput
from kda_kernels.torch_chunk import TorchChunk

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


@pytest.fixture
def check(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(offsets, "THRESHOLD", LOW)
    registry.register(WrapsPastThreshold.name, WrapsPastThreshold, replace=True)
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
    # A [B, T] case runs as its packed form.
    flat = Case(seq_lens=(30, 30), num_heads=2, num_v_heads=2, head_k_dim=16, head_v_dim=16)
    assert not any(f.failed for f in run_check(check, flat, registry.get("torch_chunk"), CPU, {}, run))


def test_a_batch_that_would_not_fit_the_device_is_a_skip_saying_how_much(check, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(offsets, "device_memory", lambda device: 2**10)  # the batch takes about 60 KiB
    case = Case(seq_lens=(40,), num_heads=2, num_v_heads=2, head_k_dim=16, head_v_dim=16)
    run = Run(build_config(device="cpu", out=tmp_path), journal=False)
    [skipped] = run_check(check, case, registry.get("torch_chunk"), CPU, {}, run)
    assert skipped.verdict == "skip" and "needs about" in skipped.reason and "GiB" in skipped.reason, skipped


def test_a_case_too_narrow_to_reach_the_threshold_gets_more_heads(check, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(offsets, "MAX_FILLER_TOKENS", 64)
    case = Case(seq_lens=(40,), num_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16)  # 257 tokens of filler
    backend = registry.get("torch_chunk")
    wide = check.prepare(case, backend)
    assert (wide.num_heads, wide.num_v_heads, wide.packed) == (5, 10, True)  # 52 tokens of filler, GVA kept
    assert check.prepare(wide, backend) == wide
    run = Run(build_config(device="cpu", out=tmp_path), journal=False)
    found = run_check(check, case, backend, CPU, {}, run)
    assert found and all(f.verdict == "pass" for f in found), found
