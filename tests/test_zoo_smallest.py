"""The planted-bug zoo on its smallest cases, in seconds: every planted bug is caught by one check on one small
case that reaches it, and the correct baseline passes that same check and case. The contributor tier runs this
(test_planted_bugs.py's detection run over the `ci` profile is the slow, thorough one); a bug added to the zoo
needs its small case here, or the budget check's two default cases must catch it."""

from __future__ import annotations

import pytest
import torch
from suite_paths import import_plugin

from kda_cases.case import Case
from kda_conformance.checks import CHECKS, run_check
from kda_kernels import registry

CPU = torch.device("cpu")
SMALL_HEADS = dict(num_heads=2, num_v_heads=2, head_k_dim=32, head_v_dim=32)
TWO_SEQUENCES = Case(seq_lens=(20, 30), packed=True, **SMALL_HEADS)

# What the budget check runs for a bug this table does not name: a packed batch with a zero-length member,
# GVA, an initial state and a checkpoint; and an fp32 sequence past two chunks.
DEFAULT_CASES = (
    Case(seq_lens=(37, 0, 90), packed=True, num_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32,
         initial_state="random", checkpoints=((2, 70),)),
    Case(seq_lens=(130,), dtype="fp32", initial_state="random", **SMALL_HEADS),
)  # fmt: skip

# bug -> (check, the small case that reaches it, the check's parameters)
SMALLEST: dict[str, tuple[str, Case, dict[str, object]]] = {
    "planted_fresh_reads_stale_slot": ("split_resume", Case(seq_lens=(40,), **SMALL_HEADS), {"at": 17}),
    # right on its first call, off on every later one: two calls on the same inputs differ.
    "planted_keeps_state_between_calls": ("determinism", Case(seq_lens=(40,), **SMALL_HEADS), {}),
    "planted_reads_strided_as_contiguous": ("budget", Case(seq_lens=(40,), input_layout="fused", **SMALL_HEADS), {}),
    "planted_clamps_large_values": ("budget", Case(seq_lens=(40,), input_scale="large", **SMALL_HEADS), {}),
    "planted_sequence_table_wraps_past_8": ("budget", Case(seq_lens=(5,) * 10, packed=True, **SMALL_HEADS), {}),
    # 33 sequences of 4 value heads: 132 (sequence, head) programs, past the planted grid of 128.
    "planted_drops_programs_past_128": (
        "budget",
        Case(seq_lens=(2,) * 33, packed=True, num_heads=4, num_v_heads=4, head_k_dim=16, head_v_dim=16),
        {},
    ),
    # 3 % off past token 2048: fp32's limits see it on 52 tokens (bf16's do not, on so few).
    "planted_wrong_past_2048": (
        "budget",
        Case(seq_lens=(2100,), dtype="fp32", num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16),
        {},
    ),
    "planted_reads_fp32_gate_as_token_dtype": ("budget", Case(seq_lens=(40,), gate_dtype="fp32", **SMALL_HEADS), {}),
    "planted_l2norm_without_eps": ("budget", Case(seq_lens=(40,), zero_tokens="rows", **SMALL_HEADS), {}),
    "planted_pool_fresh_reads_slot": ("poison", TWO_SEQUENCES, {"poison": "nan"}),
    "planted_padding_writes_slot0": ("poison", TWO_SEQUENCES, {"poison": "nan"}),
    "planted_pad_wraps_to_last_slot": ("poison", TWO_SEQUENCES, {"poison": "nan"}),
    # seed 1: the padding entries carry vLLM's sentinel 0 (kernels/serving.py pad_slot_for).
    "planted_null_slot_padding_as_a_slot": (
        "poison",
        TWO_SEQUENCES.replace(initial_state="random", seed=1),
        {"poison": "nan"},
    ),
    "planted_checkpoint_slot_unwritten": (
        "poison",
        Case(seq_lens=(40,), checkpoints=((0, 20),), **SMALL_HEADS),
        {"poison": "nan"},
    ),
    "planted_uninitialised_output_tail": ("poison", TWO_SEQUENCES, {"poison": "nan"}),
    "planted_pool_dense_addressing": (
        "poison",
        TWO_SEQUENCES.replace(initial_state="random", pool_layout="padded"),
        {"poison": "nan"},
    ),
    "planted_out_from_storage_start": ("poison", TWO_SEQUENCES, {"poison": "nan"}),
    "planted_cu_seqlens_identity_cache": ("cu_seqlens", TWO_SEQUENCES, {}),
}


def _zoo() -> list[str]:
    return list(import_plugin("kda_planted_bugs").ZOO)


ZOO = _zoo()


def _failed(name: str, check: str, case: Case, params: dict[str, object]) -> bool:
    backend = registry.get(name)
    prepared = CHECKS[check].prepare(backend.fit(case), backend)
    return any(f.failed for f in run_check(CHECKS[check], prepared, backend, CPU, params))


def test_the_table_names_only_planted_bugs() -> None:
    assert set(SMALLEST) <= set(ZOO), set(SMALLEST) - set(ZOO)


@pytest.mark.parametrize("name", ZOO)
def test_each_planted_bug_is_caught_on_its_smallest_case(name: str) -> None:
    check, case, params = SMALLEST.get(name, ("budget", None, {}))
    cases = (case,) if case is not None else DEFAULT_CASES
    assert any(_failed(name, check, c, params) for c in cases), f"{name}: {check} passed on {[c.label for c in cases]}"
    assert not _failed("torch_chunk", check, cases[0], params), f"the baseline fails {check} on {cases[0].label}"
