"""The suite from a kernel engineer's own test file (conformance/testing.py): assert_conforms on a callable,
a backend or a backend's name; the case strategy with fixed fields; the session fixture's records."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from kda_conformance.running.config import RunConfig
from kda_conformance.running.run import Run
from kda_conformance.testing import Case, Checker, Envelope, as_backend, assert_conforms, kda_cases, preset
from kda_kernels.torch_chunk import TorchChunk
from kda_reports.store import load_store

CASE = Case(seq_lens=(37,), num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
BASELINE = TorchChunk()


def test_a_registered_backend_passes_and_every_finding_comes_back() -> None:
    findings = assert_conforms("torch_chunk", CASE, device="cpu")
    assert {f.verdict for f in findings} == {"pass"} and {f.tensor for f in findings} == {"o", "final_state"}


def test_a_wrong_callable_raises_the_suites_report_with_a_python_repro() -> None:
    def zero_output(q, k, v, g, beta, *, initial_state=None, output_final_state=True, **kwargs):
        state = torch.zeros(q.shape[0], v.shape[2], q.shape[3], v.shape[3], dtype=torch.float32)
        return torch.zeros_like(v), state

    with pytest.raises(AssertionError) as raised:
        assert_conforms(zero_output, CASE, device="cpu")
    report = str(raised.value)
    assert "budget: kda-" in report and "backend " in report and "x its limit" in report
    assert "first bad: seq 0 token 0 head 0" in report
    assert "repro: assert_conforms(" in report and "Case.from_json(" in report and "kda-conformance run" not in report


def test_a_callable_is_called_with_chunk_kdas_keywords() -> None:
    seen = {}

    def spy(q, k, v, g, beta, *, safe_gate=False, **kwargs):
        seen.update(kwargs, safe_gate=safe_gate)
        return torch.zeros_like(v), None

    with pytest.raises(AssertionError):
        assert_conforms(spy, CASE.replace(initial_state="random"), device="cpu")
    assert seen["output_final_state"] is True and seen["safe_gate"] is True and seen["lower_bound"] == -5.0
    assert seen["initial_state"].dtype == torch.float32 and seen["use_gate_in_kernel"] is True


def test_bad_arguments_are_one_clear_error_each() -> None:
    with pytest.raises(ValueError, match=r"kernel 'nope' is no registered backend; choose from .*torch_chunk"):
        assert_conforms("nope", CASE, device="cpu")
    with pytest.raises(TypeError, match="kernel must be a callable"):
        assert_conforms(3, CASE, device="cpu")
    narrow = as_backend(lambda *a, **k: None, name="bf16_only", envelope=Envelope(dtypes=("bf16",)))
    with pytest.raises(ValueError, match=r"cases: kda-.* is outside bf16_only's envelope"):
        assert_conforms(narrow, CASE.replace(dtype="fp32"), device="cpu")
    with pytest.raises(ValueError, match="params: check split_resume takes at"):
        assert_conforms("torch_chunk", CASE, checks=["split_resume"], device="cpu")
    with pytest.raises(ValueError, match="check 'nope' unknown"):
        assert_conforms("torch_chunk", CASE, checks=["nope"], device="cpu")
    with pytest.raises(ValueError, match="kda_cases: dtyp are no Case fields"):
        kda_cases("ci", dtyp="bf16")


def test_a_check_with_parameters_and_a_case_as_json() -> None:
    packed = {"seq_lens": [20, 0, 13], "packed": True, "num_heads": 1, "num_v_heads": 1, "head_k_dim": 16,
              "head_v_dim": 16}  # fmt: skip
    findings = assert_conforms(BASELINE, packed, checks=["split_resume"], params={"at": 9}, device="cpu")
    assert findings and {f.check for f in findings} == {"split_resume"} and not any(f.failed for f in findings)


@settings(max_examples=8, deadline=None)
@given(case=kda_cases("smoke", dtype="fp16", num_heads=1, num_v_heads=1))
def test_drawn_cases_keep_their_fixed_fields(case: Case) -> None:
    assert case.dtype == "fp16" and case.num_heads == case.num_v_heads == 1


def test_the_session_checker_records_into_a_store(tmp_path) -> None:
    run = Run(RunConfig(device=torch.device("cpu"), backends=(), out=tmp_path, command="pytest"))
    checker = Checker(run)
    checker("torch_chunk", [CASE, CASE.replace(dtype="fp32")])
    with pytest.raises(AssertionError):
        checker(lambda q, k, v, g, beta, **kw: (torch.zeros_like(v), None), CASE)
    run.finish()
    records = load_store(tmp_path).records
    assert set(records["verdict"]) == {"pass", "fail"} and records["case_id"].nunique() == 2


def test_a_case_takes_torch_dtypes_as_fla_spells_them() -> None:
    # "dtype=torch.bfloat16 is not allowed; choose one of bf16, fp16, fp32"
    spelled = Case(dtype=torch.bfloat16, state_dtype=torch.float32, gate_dtype="same")
    assert spelled == Case() and spelled.id == Case().id
    assert Case(dtype=torch.float16).dtype == "fp16" and Case(dtype="float32").dtype == "fp32"
    with pytest.raises(ValueError, match=r"dtype=.torch.float64. is not allowed; choose one of bf16, fp16, fp32"):
        Case(dtype=torch.float64)


def test_the_fla_preset_is_chunk_kdas_own_defaults() -> None:
    case = preset("fla", seq_lens=(300,), dtype=torch.bfloat16)
    assert (case.gate, case.lower_bound, case.safe_gate) == ("log", None, False)
    assert not case.beta_sigmoid_in_kernel and not case.l2norm_in_kernel and case.seq_lens == (300,)
    with pytest.raises(ValueError, match=r"preset 'vllm' is unknown.*choose a library's \(fla\) or a backend's layer"):
        preset("vllm")


def test_a_servers_preset_is_its_layers_case_as_the_backend_that_calls_it_declares() -> None:
    """GLM-5.3-Flash's layer (vllm_glm5_chunk): the safe lower-bound gate, q/k normalised in the kernel, one head
    size for K and V, as many value heads as key heads; every other field as given."""
    case = preset("vllm_glm5_chunk", seq_lens=(64,), head_k_dim=64, head_v_dim=32, num_heads=2, num_v_heads=4,
                  l2norm_in_kernel=False, safe_gate=False, initial_state="random")  # fmt: skip
    assert (case.gate, case.safe_gate, case.l2norm_in_kernel) == ("lower_bound", True, True)
    assert case.head_k_dim == case.head_v_dim and case.num_v_heads == case.num_heads
    assert case.seq_lens == (64,) and case.initial_state == "random"
    assert preset("aiter_flashkda", seq_lens=(64,), dtype="fp32").dtype == "bf16"
    with pytest.raises(ValueError, match="did you mean 'vllm_glm5_chunk'"):
        preset("vllm_glm5")


def _naive(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """FLA's naive_recurrent_kda's signature (fla/ops/kda/naive.py): no cu_seqlens, no in-kernel flags."""
    return BASELINE.run(materialized_as(q, k, v, g, beta, scale, initial_state))


def materialized_as(q, k, v, g, beta, scale, initial_state):
    from kda_cases.materialize import KDAInputs

    T, H, K, V = q.shape[1], q.shape[2], q.shape[3], v.shape[3]
    case = preset("fla", seq_lens=(T,), dtype="fp32", num_heads=H, num_v_heads=v.shape[2], head_k_dim=K, head_v_dim=V)
    case = case.replace(initial_state="random" if initial_state is not None else "none", scale=scale)
    inputs = KDAInputs(case, q, k, v, g, beta, None, None, initial_state, None)
    return inputs


def test_a_callable_without_a_keyword_the_case_needs_is_told_which_before_any_call() -> None:
    # assert_conforms(naive_recurrent_kda, case) failed with "unexpected keyword argument 'cu_seqlens'".
    calls = []

    def naive(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
        calls.append(1)
        out = _naive(q, k, v, g, beta, scale, initial_state)
        return out.o, out.final_state

    small = {"num_heads": 1, "num_v_heads": 1, "head_k_dim": 16, "head_v_dim": 16}
    with pytest.raises(ValueError, match=r"naive takes no keyword cu_seqlens \(packed sequences\), which this case"):
        assert_conforms(naive, preset("fla", seq_lens=(20, 13), packed=True, **small), device="cpu")
    with pytest.raises(ValueError, match=r"use_gate_in_kernel \(.*preset\('fla', \.\.\.\)"):
        assert_conforms(naive, Case(seq_lens=(20,), **small), device="cpu")
    assert not calls
    fla = preset("fla", seq_lens=(37,), dtype=torch.float32, initial_state="random", **small)
    assert {f.verdict for f in assert_conforms(naive, fla, device="cpu")} == {"pass"}


def test_a_wrapper_that_takes_the_flags_only_through_kwargs_is_told_so_when_it_fails() -> None:
    # A wrapper that swallowed **kwargs got "8192 non-finite values" with no hint the gate flags were dropped.
    def drops_flags(q, k, v, g, beta, **kwargs):
        out = _naive(q, k, v, g, beta, kwargs.get("scale"), kwargs.get("initial_state"))
        return out.o, out.final_state

    with pytest.raises(AssertionError) as raised:
        assert_conforms(drops_flags, CASE, device="cpu")
    assert "drops_flags takes use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, use_gate_in_kernel" in str(
        raised.value
    )


def test_a_closures_repro_names_it_runnably_and_says_it_is_not_importable() -> None:
    # It read "assert_conforms(scaled.<locals>.k, ...)", which no file can run.
    def scaled(factor: float):
        def k(q, k, v, g, beta, **kwargs):
            out = BASELINE.run(materialized_as(q, k, v, g, beta, kwargs.get("scale"), kwargs.get("initial_state")))
            return out.o * factor, out.final_state

        return k

    with pytest.raises(AssertionError) as raised:
        assert_conforms(scaled(2.0), preset("fla", seq_lens=(37,), num_heads=1, num_v_heads=1, head_k_dim=16,
                                            head_v_dim=16), device="cpu")  # fmt: skip
    report = str(raised.value)
    assert "repro: assert_conforms(k, Case.from_json(" in report
    assert "scaled.<locals>.k is defined inside a function: not importable, pass that callable" in report
