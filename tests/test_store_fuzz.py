"""Every kind of run file, damaged every way a disk, a killed writer or a hand edit damages it: each reader
(the store, the dashboard, findings, diff, shards) names the bad file or field, keeps the rest and exits
with its own code, never a traceback."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pandas as pd
import pytest

from kda_conformance.cli import main
from kda_reports.quarantine import Quarantined, append_quarantine
from kda_reports.runfile import RUN_FILE_SUFFIXES
from kda_reports.store import load_store

CASE = '{"seq_lens": [9], "num_heads": 1, "num_v_heads": 1, "head_k_dim": 16, "head_v_dim": 16}'


def _cut(text: bytes) -> bytes:
    return text[: len(text) // 2]


# Damage that any file can take, by its bytes.
BYTES: dict[str, Callable[[bytes], bytes]] = {
    "empty": lambda text: b"",
    "cut in half": _cut,
    "not UTF-8": lambda text: text[:9] + b"\xff\xfe\xc3" + text[9:],
    "a lone surrogate escaped": lambda text: text.replace(b'"', b'"\\udcff', 1),
    "zeros": lambda text: b"\0" * len(text),
}


def _with(field: str, value: object, data: dict) -> dict:
    return {**data, field: value}


FIELDS = ("wall_seconds", "workers", "compile", "cache", "tests", "seconds", "run_id", "device_name")
KINDS = (("text", "abc"), ("a list", [1, "x"]), ("a mapping", {"a": [1]}), ("null", None))
# Damage a JSON file takes as JSON: another top-level type, or a field of another type.
JSON: dict[str, Callable[[dict], object]] = {
    "a list": lambda data: [data],
    "a string": lambda data: "night",
    **{f"{field} as {kind}": partial(_with, field, value) for field in FIELDS for kind, value in KINDS},
    "compile seconds by backend as a list": partial(_with, "compile", {"seconds_by_backend": [3]}),
    "a test's seconds as text": partial(_with, "tests", {"x::t[torch_chunk]": "slow"}),
}
# Damage that leaves nothing of the file to read: the readers of a run's records, environment and night
# must name the file.
UNREADABLE = ("empty", "cut in half", "not UTF-8", "zeros", "a list", "a string")
NAMED_BY_THE_STORE = ("records", "environment", "night")


def _as_json(how: Callable[[dict], object], text: bytes) -> bytes:
    return json.dumps(how(json.loads(text))).encode()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """A store with two runs (the intact one, the one to damage), each with every run file kind a night
    writes."""
    out = tmp_path_factory.mktemp("store")
    runs = out / "runs"
    for _ in range(2):
        argv = ["run", "--device", "cpu", "--backend", "torch_chunk", "--case", CASE, "--out", str(out)]
        assert main([*argv, "--no-dashboard"]) == 0
    intact, damaged = sorted(p.name.split(".")[0] for p in runs.glob("*.parquet"))
    for run_id in (intact, damaged):
        night = {
            "part": "",
            "wall_seconds": 12.5,
            "workers": 2,
            "memory_plan": "",
            "kernel_configs": 1,
            "compile": {"jobs": 1, "seconds": 3.0, "wall_seconds": 2.0, "seconds_by_backend": {"torch_chunk": 3.0}},
            "cache": {"dir": "cache", "state": "cold", "before": [0, 0], "after": [1, 10]},
        }
        (runs / f"{run_id}.night.json").write_text(json.dumps(night))
        timing = json.loads((runs / f"{run_id}.timing.json").read_text())
        timing["tests"] = {"conformance/test_corpus.py::test_corpus_case[torch_chunk-x]": 1.5}
        (runs / f"{run_id}.timing.json").write_text(json.dumps(timing))
        entry = Quarantined("torch_chunk", "H1/1 K16 V16 bf16", "kda-000000000000", "compile", "a crash")
        append_quarantine(runs / f"{run_id}.quarantine.jsonl", entry)
        (runs / f"{run_id}.checks.json").write_text(json.dumps({"test_within_budget[torch_chunk]": [1, 2]}))
    return out, intact, damaged


def _kinds() -> list[str]:
    return ["records", "environment", "timing", "night", "quarantine", "checks", "summary_md", "summary_csv"]


def _damages(kind: str) -> list[tuple[str, Callable[[bytes], bytes]]]:
    damages = list(BYTES.items())
    if RUN_FILE_SUFFIXES[kind].endswith(".json"):
        damages += [(name, partial(_as_json, how)) for name, how in JSON.items()]
    return damages


CASES = [(kind, name, how) for kind in _kinds() for name, how in _damages(kind)]


@pytest.mark.parametrize(("kind", "damage", "how"), CASES, ids=[f"{k}-{d}" for k, d, _ in CASES])
def test_a_damaged_run_file_is_named_and_the_rest_is_kept(
    store: tuple[Path, str, str], tmp_path: Path, kind: str, damage: str, how: Callable[[bytes], bytes], capsys
) -> None:
    source, INTACT, DAMAGED = store
    root = tmp_path / "store"
    shutil.copytree(source, root)
    path = root / "runs" / f"{DAMAGED}.{RUN_FILE_SUFFIXES[kind]}"
    if not path.exists():
        pytest.skip(f"a run writes no {kind} file here")
    path.write_bytes(how(path.read_bytes()))
    intact = pd.read_parquet(root / "runs" / f"{INTACT}.parquet")

    loaded = load_store(root)
    if kind in NAMED_BY_THE_STORE and damage in UNREADABLE:
        assert any(line.startswith(path.name) for line in loaded.problems), loaded.problems
    kept = loaded.records[loaded.records["run_id"] == INTACT]
    assert len(kept) == len(intact), "no valid row of the other run is lost"
    assert set(loaded.nights["run_id"]) >= {INTACT} and INTACT in set(loaded.quarantines["run_id"])
    for command in (
        ["dashboard", "--store", str(root)],
        ["findings", "--store", str(root), "--out", str(tmp_path / "findings")],
        ["diff", str(root / "runs" / f"{INTACT}.parquet"), str(root)],
        ["shards", "--store", str(root), "--run-id", DAMAGED],
        ["shards", "--store", str(root), "--run-id", INTACT],
    ):
        code = main(command)  # a traceback fails the test; every code is the command's own
        assert code in (0, 1, 2), (command, code)
    printed = capsys.readouterr()
    assert "Traceback" not in printed.out + printed.err
