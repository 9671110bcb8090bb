"""A night's shards (conformance/running/shards.py): whole backends to a shard, balanced by measured cost,
so each shard's compile stage compiles its own backends' configurations only."""

from __future__ import annotations

import json
from pathlib import Path

from kda_cases.case import Case
from kda_conformance.cli import main
from kda_conformance.running import shards
from kda_conformance.running.compile import shard_jobs

CHECKS = ("test_within_budget", "test_prefix_outputs_ignore_later_tokens", "test_padded_tail_holds_no_garbage")


def nodeids(backends: list[str]) -> list[str]:
    drawn = [f"conformance/test_properties.py::{check}[{b}]" for b in backends for check in CHECKS]
    pinned = [
        f"conformance/test_corpus.py::test_sentinel[{b}-T37_bf16-kda-{n:012x}]" for b in backends for n in range(4)
    ]
    return drawn + pinned


def test_each_backend_goes_whole_to_one_shard_heaviest_first_onto_the_lightest() -> None:
    names = nodeids(["a", "b", "c", "d", "e"])
    costs = shards.Costs({"a": 10.0, "b": 9.0, "c": 5.0, "d": 4.0, "e": 2.0})
    plan = shards.plan(names, 2, costs)
    assert sorted(name for shard in plan.shards for name in shard) == sorted(names)
    assert [sorted({shards.backend_of(n) for n in shard}) for shard in plan.shards] == [["a", "d", "e"], ["b", "c"]]
    assert plan.loads == (16.0, 14.0)
    assert plan.shards[0][0] == names[0], "a shard keeps the collection's order (the drawn tests first)"
    assert plan.line(1).startswith("shard 1/2: 21 tests of a, d, e; 53% of the night by cost")


def test_without_a_cost_file_each_test_weighs_the_same_and_an_unknown_backend_the_mean() -> None:
    plan = shards.plan(nodeids(["a", "b", "c"]) + nodeids(["d"])[:3], 2, shards.Costs({}))  # 7, 7, 7 and 3 tests
    assert plan.loads == (14.0, 10.0) and plan.groups == (("a", "c"), ("b", "d"))
    assert shards.Costs({"a": 30.0, "b": 10.0}).of("new", 7) == 20.0


def test_a_backend_heavier_than_a_share_is_split_by_test() -> None:
    names = nodeids(["big", "small1", "small2"])
    plan = shards.plan(names, 3, shards.Costs({"big": 100.0, "small1": 10.0, "small2": 10.0}))
    holding_big = [i for i, shard in enumerate(plan.shards) if any("[big" in n for n in shard)]
    assert len(holding_big) >= 2 and sum(len(s) for s in plan.shards) == len(names)
    assert any("(part 1 of" in name for group in plan.groups for name in group)


def test_a_shard_of_whole_backends_compiles_only_its_own_backends() -> None:
    backends = ["torch_chunk", "fla_chunk", "fla_recurrent", "fla_chunk32"]
    pool = [Case(seq_lens=(100,), num_heads=4, num_v_heads=4), Case(seq_lens=(10,), head_k_dim=32)]
    plan = shards.plan(nodeids(backends), 4, shards.Costs({}))
    per_shard = [{job.backend for job in shard_jobs(list(shard), [], pool)} for shard in plan.shards]
    assert sorted(len(b) for b in per_shard) == [1, 1, 1, 1] and set().union(*per_shard) == set(backends)


def test_the_shards_command_writes_the_cost_file_from_a_runs_test_seconds(tmp_path: Path, capsys) -> None:
    runs = tmp_path / "store" / "runs"
    runs.mkdir(parents=True)
    for part, tests in (
        ("s1of2", {"x::t[fla_chunk]": 30.0, "x::u[fla_chunk]": 12.5}),
        ("s2of2", {"x::t[aiter]": 7.0, "x::t[sglang]": 40.0}),
    ):
        (runs / f"night-a.{part}.timing.json").write_text(json.dumps({"tests": tests}))
        env = {"device_type": "cuda", "device_name": "NVIDIA H200"}
        (runs / f"night-a.{part}.env.json").write_text(json.dumps(env))
    (runs / "night-a.s1of2-gw0.timing.json").write_text(json.dumps({"seconds": {}}))  # a worker's part: none
    out = tmp_path / "costs.json"
    assert (
        main(["shards", "--store", str(tmp_path / "store"), "--run-id", "night-a", "--count", "2", "--write", str(out)])
        == 0
    )
    printed = capsys.readouterr().out
    assert "4 tests, 90 s over 3 backends" in printed and "shard 2/2: 2 tests of sglang, aiter; 53%" in printed
    data = json.loads(out.read_text())
    assert data["backends"] == {"aiter": 7.0, "fla_chunk": 42.5, "sglang": 40.0} and data["device"] == "NVIDIA H200"
    costs = shards.costs_for("NVIDIA H200", tmp_path / "nowhere")
    assert costs.backends == {} and "no cost file" in costs.source
    (tmp_path / "nvidia-h200.json").write_text(out.read_text())
    assert shards.costs_for("NVIDIA H200", tmp_path).backends == data["backends"]
    # An H100 has no file of its own here: the H200's stands in (the same architecture), and says so.
    h100 = shards.costs_for("NVIDIA H100 80GB HBM3", tmp_path)
    assert h100.backends == data["backends"]
    assert "nvidia-h200.json (run night-a" in h100.source and "standing in for NVIDIA H100 80GB HBM3" in h100.source
    (tmp_path / "nvidia-h100-80gb-hbm3.json").write_text(json.dumps({**data, "backends": {"fla_chunk": 1.0}}))
    assert shards.costs_for("NVIDIA H100 80GB HBM3", tmp_path).backends == {"fla_chunk": 1.0}  # its own wins
    assert shards.costs_for("NVIDIA A100-SXM4-80GB", tmp_path).backends == {}  # no stand-in named for it
    assert main(["shards", "--store", str(tmp_path / "store"), "--run-id", "night-b"]) == 2
