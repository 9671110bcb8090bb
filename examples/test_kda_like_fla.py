"""A kernel's own test file, in the style of FLA's tests/ops/test_kda.py, checked by the suite: the float64
truth instead of a hand-picked tolerance against an fp32 loop, and a report with every limit, ratio and first
bad point when it fails. Run it as any pytest file (`pytest examples/test_kda_like_fla.py`); on a machine
without a GPU FLA's Triton kernels run in Triton's interpreter (slow: keep the cases small)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from kda_conformance.testing import (
    Case,
    assert_conforms,
    kda_cases,
    kda_checker,  # noqa: F401  (the fixture: records into a run store)
    preset,
    use_triton_interpreter_on_cpu,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    use_triton_interpreter_on_cpu()  # before anything imports triton or fla


def fused_recurrent_kda(q, k, v, g, beta, **kwargs):
    """The kernel under test: any callable with chunk_kda's signature (here FLA's per-token kernel)."""
    from fla.ops.kda import fused_recurrent_kda as kernel

    return kernel(q, k, v, g, beta, **kwargs)


@pytest.mark.parametrize(
    ("T", "H", "D", "dtype", "initial_state"),
    [(37, 1, 16, "bf16", "none"), (65, 2, 16, "fp32", "random")],
)
def test_fused_recurrent(T: int, H: int, D: int, dtype: str, initial_state: str) -> None:
    case = Case(seq_lens=(T,), num_heads=H, num_v_heads=H, head_k_dim=D, head_v_dim=D, dtype=dtype,
                initial_state=initial_state)  # fmt: skip
    assert_conforms(fused_recurrent_kda, case, device=DEVICE)


@pytest.mark.parametrize(
    ("T", "H", "D", "scale", "dtype"),
    [(37, 1, 16, 1.0, torch.float), (64, 2, 16, 0.1, torch.bfloat16)],
)
def test_fused_recurrent_as_flas_test_calls_it(T: int, H: int, D: int, scale: float, dtype: torch.dtype) -> None:
    """FLA's own conventions (chunk_kda's defaults): g = logsigmoid(...) and beta = sigmoid(...) computed
    before the call, q and k normalised outside, FLA's dtypes, an fp32 initial state."""
    case = preset("fla", seq_lens=(T,), num_heads=H, num_v_heads=H, head_k_dim=D, head_v_dim=D, dtype=dtype,
                  scale=scale, initial_state="random")  # fmt: skip
    assert_conforms(fused_recurrent_kda, case, device=DEVICE)


def test_fused_recurrent_varlen_resumes_from_a_split() -> None:
    case = Case(seq_lens=(20, 0, 13), packed=True, num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    assert_conforms(fused_recurrent_kda, case, checks=["budget", "split_resume"], params={"at": 9}, device=DEVICE)


@settings(max_examples=5, deadline=None)
@given(case=kda_cases("smoke", dtype="bf16"))
def test_the_baseline_on_drawn_cases(case: Case) -> None:
    """The suite's own PyTorch baseline, by its registered name, on cases the suite's strategy draws."""
    assert_conforms("torch_chunk", case, device=DEVICE)


def test_with_the_fixture(kda_checker) -> None:  # noqa: F811
    kda_checker("torch_chunk", [Case(seq_lens=(40,)), Case(seq_lens=(7, 9), packed=True)], checks=["budget"])


def chunk_kda(q, k, v, g, beta, **kwargs):
    """FLA's chunk kernel, forward and backward: the kernel KDA models are trained with."""
    from fla.ops.kda import chunk_kda as kernel

    return kernel(q, k, v, g, beta, **kwargs)


# The dtype of the gradient tests: bf16 on a GPU, as models train (an fp32 call there meets FLA's TF32 dots, a
# design the registered backend fla_chunk declares and a bare callable cannot). On a CPU, where Triton's
# interpreter runs FLA's kernels, bf16 passes too but took 222 s against fp32's 62 s on 2 cores (each bf16
# operation decoded and rounded back): fp32 there.
GRAD_DTYPE = "bf16" if DEVICE == "cuda" else "fp32"


# One row on a CPU's budget (FLA's own file has many): the gate with its lower bound and safe gate, the default
# case's, is test_chunk_varlen's; this row crosses a 64-token chunk with the softplus gate.
@pytest.mark.parametrize(("T", "H", "D", "gate"), [(65, 1, 16, "softplus")])
def test_chunk(T: int, H: int, D: int, gate: str) -> None:
    """FLA's test_chunk with its gradients: o and the final state, then dq, dk, dv, dg, dbeta, dh0 (and dA_log,
    ddt_bias for the gate computed in the kernel) against the float64 gradients, each within its budget, instead
    of an RMS ratio of 0.007 to 0.02 against an fp32 loop."""
    bound = {"lower_bound": -5.0, "softplus": None}[gate]
    case = Case(seq_lens=(T,), num_heads=H, num_v_heads=H, head_k_dim=D, head_v_dim=D, dtype=GRAD_DTYPE, gate=gate,
                lower_bound=bound, safe_gate=bound is not None, initial_state="random")  # fmt: skip
    assert_conforms(chunk_kda, case, grad=True, device=DEVICE)


def test_chunk_varlen() -> None:
    """FLA's test_chunk_varlen with its gradients: packed sequences (one of them empty) and initial states."""
    case = Case(seq_lens=(30, 0, 41), packed=True, num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16,
                dtype=GRAD_DTYPE, initial_state="random")  # fmt: skip
    assert_conforms(chunk_kda, case, grad=True, device=DEVICE)
