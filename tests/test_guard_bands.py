"""Guard bands (cases/guards.py): every input a backend is handed lies inside poisoned memory, so a read past
its end shows in the result and a write past it is named by the call contract; the values and the float64
truth are what they were."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kda_cases.case import Case
from kda_cases.guards import GUARD, INTEGER_POISON, bands, memory_of
from kda_cases.materialize import KDAInputs, drawn_on_cpu, materialize
from kda_conformance.checks import get_check, run_check
from kda_kernels import registry
from kda_kernels.guard import run_backend_call, take_breaches
from kda_kernels.protocol import BackendOutput
from kda_kernels.torch_chunk import TorchChunk

CPU = torch.device("cpu")
CASE = Case(seq_lens=(30, 0, 9), packed=True, initial_state="random", num_heads=1, num_v_heads=2, head_k_dim=16,
            head_v_dim=16)  # fmt: skip


@pytest.mark.parametrize("layout", ["contiguous", "fused", "head_major"])
def test_every_input_lies_inside_poison_with_its_values_and_strides_kept(layout: str) -> None:
    case = CASE.replace(input_layout=layout)
    inputs, drawn = materialize(case, CPU), drawn_on_cpu(case)
    for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens"):
        x, want = getattr(inputs, name), getattr(drawn, name)
        if want is None:
            assert x is None
            continue
        assert torch.equal(x, want) and x.shape == want.shape, name
        around = bands(x)
        assert around.numel() >= 2 * GUARD, name
        ends = torch.cat([memory_of(x)[:GUARD], memory_of(x)[-GUARD:]])
        if x.dtype.is_floating_point:
            assert bool(ends.isnan().all()), name
        else:
            assert bool((ends == INTEGER_POISON).all()), name
    if layout == "fused":  # one fused buffer, one guarded copy of it: q, k and v still views of one memory
        assert inputs.q.untyped_storage().data_ptr() == inputs.v.untyped_storage().data_ptr()


def test_a_read_past_the_end_of_g_is_a_non_finite_result_not_a_lucky_one(planted_zoo: dict) -> None:
    case = CASE.replace(dtype="fp32")
    findings = run_check(get_check("budget"), case, registry.get("planted_reads_past_the_end_of_g"), CPU)
    failed = [f for f in findings if f.failed]
    assert failed and all(f.verdict == "fail" for f in failed), [f.message() for f in findings]
    assert any(f.errors is not None and f.errors.nonfinite and f.tensor == "o" for f in failed)


class WritesPastTheEndOfV(TorchChunk):
    name = "test_writes_past_the_end_of_v"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        end = inputs.v.storage_offset() + inputs.v.numel()
        memory_of(inputs.v)[end : end + 3] = 0.0  # a store whose mask forgot the tail
        return super().run(inputs)


def test_a_write_past_the_end_of_an_input_is_a_named_breach_and_is_put_back() -> None:
    inputs = materialize(CASE, CPU)
    take_breaches()
    result = run_backend_call(WritesPastTheEndOfV(), inputs)
    assert isinstance(result, BackendOutput)
    [breach] = take_breaches()
    assert "wrote into the memory around its input v" in str(breach)
    assert bool(bands(inputs.v).isnan().all()), "the band is put back for the next backend"
    assert not math.isnan(float(inputs.v.float().abs().max()))


def test_the_truth_of_a_guarded_case_is_the_truth_of_its_values() -> None:
    from kda_reference.run import run_reference

    inputs = materialize(CASE, CPU)
    plain = dataclasses.replace(inputs, **{n: getattr(inputs, n).clone() for n in ("q", "k", "v", "g", "beta")})
    assert torch.equal(run_reference(inputs, "loop").o, run_reference(plain, "loop").o)
