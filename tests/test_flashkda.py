"""FlashKDA on CUDA (kernels/backends/flashkda.py) against a test double of ``flash_kda`` (tests/doubles/flash_kda): its
envelope in its own words, the arguments as FlashKDA's README passes them, and FLA's own dispatch adapter
(fla-core's ``fla/ops/kda/backends/flash_kda.py``) run for real on the double; on a GPU the real package."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kda_cases.case import Case
from kda_cases.materialize import materialize
from kda_conformance.running.truth import case_truth
from kda_kernels import registry
from kda_kernels.backends.flashkda import FlaChunkDispatch
from kda_kernels.protocol import Support, Unsupported

DOUBLES = Path(__file__).with_name("doubles")
WIDE = {"head_k_dim": 128, "head_v_dim": 128, "num_heads": 1, "num_v_heads": 1}
CASES = (
    Case(seq_lens=(40,), initial_state="random", **WIDE),
    Case(seq_lens=(20, 0, 17), packed=True, initial_state="random", state_layout="v_first", scale=0.2, **WIDE),
)


@pytest.fixture
def flash_kda(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict]]:
    monkeypatch.syspath_prepend(str(DOUBLES))
    import flash_kda

    flash_kda.CALLS.clear()
    yield flash_kda.CALLS


def _within_budget(backend: str, case: Case) -> None:
    truth = case_truth(case, torch.device("cpu"))
    out = registry.get(backend).run(materialize(case, torch.device("cpu")))
    for name, got, want in (
        ("o", out.o, truth.reference.o),
        ("final_state", out.final_state, truth.reference.final_state),
    ):
        error = float((got.double() - want).abs().max())
        assert error <= truth.budgets[name].max_abs.value, (backend, case.label, name, error)


def test_the_envelope_is_flashkdas_own_checks() -> None:
    """FlashKDA's checks (csrc/flash_kda.cpp) as an envelope record: each refusal names its field."""
    backend = registry.get("flashkda_cuda")
    assert backend.supports(CASES[0])
    reasons = {
        "dtypes bf16 (the case has fp16)": Case(seq_lens=(9,), dtype="fp16", **WIDE),
        "head_dims 128 (the case has K=64, V=64)": Case(seq_lens=(9,)),
        "gva no GVA (HV = H)": Case(seq_lens=(9,), **{**WIDE, "num_v_heads": 2}),
        "gates lower_bound (the case has log)": Case(seq_lens=(9,), gate="log", **WIDE),
        "beta_sigmoid_in_kernel True": Case(seq_lens=(9,), beta_sigmoid_in_kernel=False, **WIDE),
        "no intermediate states": Case(seq_lens=(70,), checkpoints=((0, 64),), **WIDE),
    }
    for words, case in reasons.items():
        assert words in backend.supports(case).reason, (words, backend.supports(case).reason)
    if not torch.cuda.is_available():
        assert "FlashKDA is a CUDA kernel" in backend.availability(torch.device("cpu")).reason


def test_flashkda_is_called_as_its_readme_calls_it(flash_kda: list[dict]) -> None:
    for case in CASES:
        _within_budget("flashkda_cuda", case)
    packed = flash_kda[1]
    assert packed["cu_seqlens"].dtype == torch.int64 and packed["cu_seqlens"].tolist() == [0, 20, 20, 37]
    assert packed["scale"] == 0.2 and flash_kda[0]["scale"] == 128**-0.5
    assert all(c["initial_state"].dtype == torch.float32 and c["initial_state"].is_contiguous() for c in flash_kda)


def test_fla_dispatch_runs_flas_own_adapter_and_says_when_fla_would_not_dispatch(
    flash_kda: list[dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    for case in CASES:
        _within_budget("fla_chunk_dispatch", case)
    assert len(flash_kda) == len(CASES), "FLA's adapter called flash_kda.fwd once per case"
    monkeypatch.setattr(FlaChunkDispatch, "supports", lambda self, case: Support.yes())
    fp32 = Case(seq_lens=(9,), dtype="fp32", **WIDE)
    with pytest.raises(Unsupported, match="FLA's dispatch would not hand this call to FlashKDA: FlashKDA requires bf"):
        registry.get("fla_chunk_dispatch").run(materialize(fp32, torch.device("cpu")))


def test_strided_inputs_reach_flashkda_contiguous_and_flas_dispatch_hands_them_on_as_they_are(
    flash_kda: list[dict],
) -> None:
    """A server's q, k, v are views of a fused projection (or head-major): the adapter makes what it hands
    flash_kda.fwd contiguous, its output buffer included; FLA 0.6.0's dispatch passes the caller's views on
    unchanged (its verifier checks no strides), and FlashKDA refuses them, as it did on the H200."""
    two_heads = CASES[1].replace(num_heads=2, num_v_heads=2)  # with one head a head-major view is contiguous
    for layout in ("fused", "head_major"):
        _within_budget("flashkda_cuda", two_heads.replace(input_layout=layout))
    with pytest.raises(RuntimeError, match="all tensors must be contiguous"):
        registry.get("fla_chunk_dispatch").run(materialize(two_heads.replace(input_layout="fused")))
