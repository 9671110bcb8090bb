"""Error metrics and verdict logic on synthetic results."""

from __future__ import annotations

import math

import torch

from kda_cases.case import Case
from kda_conformance.compare import first_bad, passes, tensor_error


def test_nan_fails_and_counts_as_infinite_error() -> None:
    want = torch.zeros(1, 4, 2, 3, dtype=torch.float64)
    got = want.clone().float()
    got[0, 2, 1, 0] = float("nan")
    err = tensor_error("o", got, want)
    assert err.nonfinite == 1 and math.isinf(err.max_abs)
    assert not passes(err, budget=1e30)


def test_budget_edges() -> None:
    want = torch.zeros(1, 4, 1, 1, dtype=torch.float64)
    assert passes(tensor_error("o", want + 0.99e-3, want), 1e-3)
    assert not passes(tensor_error("o", want + 1.01e-3, want), 1e-3)


def test_wrong_shape_or_missing_tensor_fails() -> None:
    want = torch.zeros(2, 2, 3, 4, dtype=torch.float64)
    transposed = tensor_error("final_state", torch.zeros(2, 2, 4, 3), want)
    assert not transposed.shape_ok and not passes(transposed, 1.0) and "shape" in transposed.detail
    assert not passes(tensor_error("final_state", None, want), 1.0)


def test_first_bad_token_in_packed_sequences() -> None:
    case = Case(seq_lens=(5, 0, 70), packed=True)
    want = torch.zeros(1, 75, 2, 4, dtype=torch.float64)
    got = want.clone()
    got[0, 5 + 66, 1, 3] = 1.0  # sequence 2, token 66, head 1
    got[0, 5 + 67, 0, 0] = 2.0
    err = tensor_error("o", got, want)
    assert first_bad(case, err, 0.5) == "seq 2 token 66 head 1"
    assert first_bad(case, err, 5.0) == ""
    assert err.curve == (0.0, 2.0)  # both hits lie in tokens 64..74 of the packed row


def test_first_bad_state_names_sequence_and_head() -> None:
    case = Case(seq_lens=(3, 3), packed=True)
    want = torch.zeros(2, 2, 4, 4, dtype=torch.float64)
    got = want.clone()
    got[1, 0, 2, 2] = 1.0
    assert first_bad(case, tensor_error("final_state", got, want), 0.1) == "seq 1 head 0"
