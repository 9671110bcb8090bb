"""Error metrics and first-bad-point location on synthetic results (verdicts: test_tolerance.py)."""

from __future__ import annotations

import math

import torch

from kda_cases.case import Case
from kda_conformance.judging.metrics import locate, measure


def test_nan_counts_as_infinite_error() -> None:
    want = torch.zeros(1, 4, 2, 3, dtype=torch.float64)
    got = want.clone().float()
    got[0, 2, 1, 0] = float("nan")
    err = measure("o", got, want).errors
    assert err.nonfinite == 1 and math.isinf(err.max_abs) and math.isinf(err.rel_rms)


def test_wrong_shape_or_missing_tensor_is_flagged() -> None:
    want = torch.zeros(2, 2, 3, 4, dtype=torch.float64)
    transposed = measure("final_state", torch.zeros(2, 2, 4, 3), want).errors
    assert not transposed.shape_ok and "shape" in transposed.detail
    assert not measure("final_state", None, want).errors.shape_ok


def test_metrics_by_hand() -> None:
    want = torch.tensor([1.0, -2.0, 2.0, 1.0], dtype=torch.float64).reshape(1, 1, 4, 1)
    got = want + torch.tensor([0.0, 0.5, 0.0, 0.0], dtype=torch.float64).reshape(1, 1, 4, 1)
    err = measure("o", got, want).errors
    ref_rms = math.sqrt((1 + 4 + 4 + 1) / 4)
    assert err.max_abs == 0.5
    assert math.isclose(err.rel_rms, math.sqrt(0.25 / 4) / ref_rms)
    assert math.isclose(err.max_abs_over_ref_rms, 0.5 / ref_rms)


def test_first_bad_token_in_packed_sequences() -> None:
    case = Case(seq_lens=(5, 0, 70), packed=True)
    want = torch.zeros(1, 75, 2, 4, dtype=torch.float64)
    got = want.clone()
    got[0, 5 + 66, 1, 3] = 1.0  # sequence 2, token 66, head 1
    got[0, 5 + 67, 0, 0] = 2.0
    measured = measure("o", got, want)
    assert str(locate(case, measured, 0.5)) == "seq 2 token 66 head 1"
    assert locate(case, measured, 5.0) is None
    assert measured.errors.curve == (0.0, 2.0)  # both hits lie in tokens 64..74 of the packed row


def test_first_bad_state_names_sequence_and_head() -> None:
    case = Case(seq_lens=(3, 3), packed=True)
    want = torch.zeros(2, 2, 4, 4, dtype=torch.float64)
    got = want.clone()
    got[1, 0, 2, 2] = 1.0
    assert str(locate(case, measure("final_state", got, want), 0.1)) == "seq 1 head 0"


def _dropping_checkpoints(claims: bool):
    """torch_chunk with its checkpoint states dropped from the result, claiming to produce them or not."""
    import dataclasses

    from kda_kernels.torch_chunk import TorchChunk

    class Dropped(TorchChunk):
        produces_checkpoints = claims

        def run(self, inputs):
            return dataclasses.replace(super().run(inputs), checkpoint_states=None)

    return Dropped()


def test_checkpoints_a_result_lacks_are_never_a_silent_pass() -> None:
    from budget_of import budget_check

    from kda_conformance.running.truth import case_truth

    truth = case_truth(Case(seq_lens=(40,), checkpoints=((0, 16), (0, 40))), torch.device("cpu"))
    claims = {f.tensor: f for f in budget_check(truth, _dropping_checkpoints(claims=True))}
    assert claims["checkpoint_states"].verdict == "fail"
    assert "returned none of the case's 2 checkpoint states" in claims["checkpoint_states"].problems[0]
    honest = {f.tensor: f for f in budget_check(truth, _dropping_checkpoints(claims=False))}
    assert honest["o"].verdict == honest["final_state"].verdict == "pass"
    assert honest["checkpoint_states"].verdict == "skip"
    assert (
        "returns no checkpoint states: the case's 2 checkpoint states are not compared"
        in honest["checkpoint_states"].reason
    )
