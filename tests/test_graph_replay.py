"""CUDA-graph replay (conformance/checks/graph_replay.py) on the CPU: its plan (what is captured, what is
rewritten in place, which batches are replayed, what is compared), the second batch's moved boundaries, and the
skip that says why it does not run here. The capture itself needs a GPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kda_cases.case import Case
from kda_cases.envelope import Envelope
from kda_cases.materialize import materialize
from kda_conformance.checks import get_check, run_check
from kda_conformance.checks.graph_replay import STATIC, _copy_into, device_tables, moved_boundaries, plan
from kda_conformance.running.blame import NotApplicable
from kda_conformance.running.config import build_config
from kda_conformance.running.run import Run
from kda_kernels import registry
from kda_kernels.protocol import Backend
from kda_kernels.torch_chunk import TorchChunk
from kda_kernels.vendored_trees import SGLANG

DOUBLES = Path(__file__).resolve().parent / "doubles"


def test_the_plan_names_what_is_captured_rewritten_and_compared() -> None:
    case = Case(seq_lens=(20, 0, 17), packed=True, initial_state="random")
    said = plan(case)
    assert said["replays"] == [(20, 0, 17), (0, 17, 20)]
    assert said["rewritten"] == [
        "q",
        "k",
        "v",
        "g",
        "beta",
        "A_log",
        "dt_bias",
        "initial_state",
        "cu_seqlens (in place)",
        "the backend's device tables (in place)",
    ]
    assert "bit for bit with the eager call" in str(said["compared"]) and case.id in str(said["captured"])


def test_the_second_batch_keeps_the_shapes_and_moves_a_boundary() -> None:
    for lengths in ((20, 0, 17), (5, 5), (64, 64, 1), (0, 7)):
        case = Case(seq_lens=lengths, packed=True)
        second = moved_boundaries(case)
        assert (second.num_seqs, second.total_tokens) == (case.num_seqs, case.total_tokens)
        assert second.offsets != case.offsets and second.seed == case.seed + 1, (lengths, second.seq_lens)
    assert moved_boundaries(Case(seq_lens=(5, 5), packed=True)).seq_lens == (4, 6)
    with pytest.raises(NotApplicable, match="no boundary can move"):
        moved_boundaries(Case(seq_lens=(1, 1), packed=True))


def test_the_check_prepares_a_case_whose_boundary_can_move() -> None:
    """Seen on an H100: the first case Hypothesis draws (one token) left no boundary to move."""
    check, backend = get_check("graph_replay"), registry.get("torch_chunk")
    for lengths, packed, expected in (
        ((1,), False, (2, 1)),
        ((1, 1), True, (2, 1)),
        ((0, 1), True, (0, 1)),
        ((1, 1, 1), True, (2, 1, 1)),
    ):
        prepared = check.prepare(Case(seq_lens=lengths, packed=packed), backend)
        assert prepared.seq_lens == expected and prepared.packed, (lengths, prepared.seq_lens)
        assert check.prepare(prepared, backend) == prepared
        moved_boundaries(prepared)  # raises where nothing can move


def test_it_runs_on_a_gpu_only_and_backends_declare_capture(tmp_path) -> None:
    check = get_check("graph_replay")
    backend = registry.get("torch_chunk")
    assert check.applies(backend, "cpu") == "check graph_replay runs on cuda only, not cpu"
    assert Envelope().graph_capture is False and check.max_examples == 1
    here = dataclasses.replace(check, devices=("cpu", "cuda"))
    run = Run(build_config(device="cpu", out=tmp_path), journal=False)
    case = Case(seq_lens=(20, 17), packed=True, num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    [skipped] = run_check(here, case, backend, torch.device("cpu"), {}, run)
    assert skipped.verdict == "skip" and "CUDA graphs need a CUDA device" in skipped.reason


def test_a_servers_device_tables_are_static_buffers_refilled_for_each_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's graph prefill builds its chunk tables on the host for the device and rewrites them in place before
    every replay: the check captures the call with them as static buffers and refills those same buffers for the
    moved boundaries (SGLang's test double asserts the tables it is handed are the batch's, row by row). A table
    that stays on the host (FLA's cu_seqlens_cpu) is not handed to a graph."""
    monkeypatch.setenv(SGLANG.variable, str(DOUBLES / "sglang_tree"))
    monkeypatch.syspath_prepend(str(DOUBLES))  # the servers' doubles' shared kernel
    backend = registry.get("sglang_chunk")
    assert backend.envelope.graph_capture  # SGLang captures it (kda_prefill_graph.py)
    case = Case(seq_lens=(130, 0, 17), packed=True, head_k_dim=32, head_v_dim=32, initial_state="random")
    cpu = torch.device("cpu")
    first, second = materialize(case, cpu), materialize(moved_boundaries(case), cpu)
    tables = device_tables(backend, first)
    assert set(tables) == {"chunk_indices", "chunk_offsets"} and tables["chunk_offsets"].tolist() == [0, 3, 3, 4]
    clones = {name: getattr(first, name).clone() for name in STATIC if getattr(first, name) is not None}
    static = dataclasses.replace(first, host_metadata={n: t.clone() for n, t in tables.items()}, **clones)
    where = {name: table.data_ptr() for name, table in static.host_metadata.items()}
    _copy_into(static, second, backend)
    assert {name: table.data_ptr() for name, table in static.host_metadata.items()} == where  # in place
    assert static.host_metadata["chunk_offsets"].tolist() == [0, 0, 1, 4]  # (0, 17, 130): 0, 1 and 3 chunks
    backend.run(static)  # the double checks the tables against the second batch's cu_seqlens

    class HostTables(TorchChunk):
        envelope = Envelope(host_metadata=("cu_seqlens_cpu",))

        def host_metadata(self, device: torch.device, cu_seqlens_cpu: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"cu_seqlens_cpu": cu_seqlens_cpu.to("meta")}  # not on the inputs' device

    assert isinstance(HostTables(), Backend) and device_tables(HostTables(), first) == {}
    assert device_tables(registry.get("torch_chunk"), first) == {}
