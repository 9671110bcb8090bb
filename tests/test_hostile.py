"""Hostile backends (tests/plugins/kda_hostile.py): each is charged what it did, every other backend's
verdict is what it would be alone (the hostile one first or last), the store keeps its row and stays
loadable, and the exit code says what happened; also where the process itself dies in the call."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
import torch
from suite_paths import PLUGINS, REPO, plugins_on_path

from kda_cases.case import Case
from kda_conformance.checks import get_check, run_check
from kda_conformance.cli import main
from kda_conformance.cli.exits import ERRORED, FAILED
from kda_kernels import registry
from kda_kernels.torch_chunk import TorchChunk
from kda_reports.findings import SUITE_BACKEND
from kda_reports.store import load_store

# Both with an initial state; the second packed, with a zero-length member (cu_seqlens to write into).
CASES = [
    Case(seq_lens=(37,), initial_state="random", num_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16),
    Case(seq_lens=(20, 0, 13), packed=True, initial_state="random", num_heads=1, num_v_heads=1, head_k_dim=16,
         head_v_dim=32),
]  # fmt: skip
CASE_ARGS = [arg for case in CASES for arg in ("--case", case.to_json())]


@pytest.fixture(scope="module", autouse=True)
def hostile() -> Iterator[dict[str, tuple[str, str]]]:
    with plugins_on_path():
        import kda_hostile

        assert kda_hostile.WRITTEN_INPUTS == INPUTS
        yield kda_hostile.EXPECTED


def run_into(out: Path, *backends: str, plugin: str = "kda_hostile") -> int:
    chosen = [arg for name in backends for arg in ("--backend", name)]
    return main(["run", "--device", "cpu", "--plugin", plugin, *chosen, *CASE_ARGS, "--out", str(out)])


def verdicts(records: pd.DataFrame, backend: str) -> dict[tuple[str, str], tuple[str, float]]:
    mine = records[records["backend"] == backend]
    return {(r.case_id, r.tensor): (r.verdict, r.max_abs) for r in mine.itertuples()}


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """torch_chunk's verdicts with no other backend beside it."""
    out = tmp_path_factory.mktemp("alone")
    assert run_into(out, "torch_chunk") == 0
    return verdicts(load_store(out).records, "torch_chunk")


# The plugin's writers, one per input a backend may read and must not write (kda_hostile.WRITTEN_INPUTS).
INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens")
WRITERS = [f"hostile_writes_{name}" for name in INPUTS]


@pytest.mark.parametrize(
    "name",
    [
        *WRITERS,
        "hostile_returns_an_input",
        "hostile_os_exit",
        "hostile_system_exit",
        "hostile_returns_none",
        "hostile_returns_a_tuple",
        "hostile_returns_meta",
        "hostile_raises_in_supports",
        "hostile_raises_in_availability",
        "hostile_raises_a_surrogate",
        "hostile_raises_keyboard_interrupt",
        "hostile_raises_unprintable",
        "hostile_returns_a_lying_subclass",
        "hostile_sets_default_dtype",
        "hostile_sets_new_matmul_precision",
        "hostile_changes_directory",
        "hostile_lowers_recursion_limit",
        "hostile_ignores_sigterm",
        "hostile_mutates_the_case",
        "hostile_leaves_a_function_mode",
        "hostile_wraps_torch_matmul",
        "hostile_turns_grad_mode",
        "hostile_closes_standard_error",
        "hostile_sets_suite_variable",
        "hostile_sets_a_variable",
        "hostile_replaces_the_baseline",
        "hostile_replaces_the_reference",
        "hostile_overwrites_the_truth",
    ],
)
def test_a_hostile_backend_is_charged_and_every_other_verdict_stands(
    name: str, hostile: dict, alone: dict, tmp_path: Path
) -> None:
    verdict, words = hostile[name]
    for order in ((name, "torch_chunk"), ("torch_chunk", name)):
        out = tmp_path / "-".join(order)
        assert run_into(out, *order) == (FAILED if verdict == "fail" else ERRORED), order
        store = load_store(out)
        assert not store.problems and list(store.runs["status"]) == ["complete"], store.problems
        mine = store.records[store.records["backend"] == name]
        assert set(mine["case_id"]) == {case.id for case in CASES}, mine  # a row for every case
        charged = mine[mine["verdict"] == verdict]
        named = charged[charged["reason"].str.contains(words, regex=False)]
        assert set(named["case_id"]) == {case.id for case in CASES}, mine  # what it did, named on every case
        if name != "hostile_overwrites_the_truth":  # whose zero answer also fails the truth made again
            assert len(named) == len(charged), charged["reason"]
        if name in WRITERS:  # the input it wrote, named (where the case has it: else it wrote q)
            written = name.removeprefix("hostile_writes_")
            assert charged["reason"].str.contains(f"its input {written}:|its input q:").all(), charged["reason"]
        assert verdicts(store.records, "torch_chunk") == alone, f"{order}: torch_chunk's verdicts moved"
        assert SUITE_BACKEND not in set(store.records["backend"])
        assert (out / "dashboard.html").stat().st_size > 0


def test_a_reused_output_buffer_with_fresh_noise_is_nondeterministic() -> None:
    # Both calls returned the same tensor: the determinism check compared it with itself ("deterministic").
    backend = registry.get("hostile_reuses_its_output_buffer")
    [varies, *_] = run_check(get_check("determinism"), CASES[0], backend, torch.device("cpu"))
    assert (varies.verdict, varies.observed) == ("warn", "nondeterministic"), varies


def test_one_exception_object_raised_by_two_backends_is_each_ones(tmp_path: Path) -> None:
    # The second backend's rows were charged to the suite as "the baseline hostile_cached_error_a raised".
    assert run_into(tmp_path, "hostile_cached_error_a", "hostile_cached_error_b", "torch_chunk") == ERRORED
    records = load_store(tmp_path).records
    assert SUITE_BACKEND not in set(records["backend"]), records[["backend", "reason"]]
    for name in ("hostile_cached_error_a", "hostile_cached_error_b"):
        mine = records[records["backend"] == name]
        assert len(mine) >= len(CASES) and set(mine["verdict"]) == {"error"}, mine


def test_a_write_into_an_input_names_its_first_changed_element(tmp_path: Path) -> None:
    assert run_into(tmp_path, "hostile_writes_q") == FAILED
    records = load_store(tmp_path).records
    row = records[(records["verdict"] == "fail") & (records["case_id"] == CASES[0].id)].iloc[0]
    assert "first changed element [0, 36, 0, 15]" in row["reason"] and row["first_bad"] == "row 0 token 36 head 0"


@pytest.mark.slow
def test_a_hung_call_without_isolation_ends_the_sweep_with_its_row(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "kda_conformance.cli", "run", "--device", "cpu", "--plugin", "kda_planted_crashes"]
    cli += ["--backend", "torch_chunk", "--backend", "planted_hang", "--case-timeout", "5", *CASE_ARGS]
    done, records = _dead([*cli, "--out", str(tmp_path)], tmp_path)
    assert done.returncode == ERRORED, done.stdout[-2000:]
    hung = records[records["backend"] == "planted_hang"]
    assert list(hung["verdict"]) == ["error"] and "no result within 5 s" in hung["reason"].iloc[0]
    assert set(records[records["backend"] == "torch_chunk"]["verdict"]) == {"pass"}


def test_a_nan_state_at_step_one_is_the_backends_failure_at_step_one() -> None:
    """On the H200 the second step's truth was computed from AITER's NaN state of the first and recorded as
    the suite's invalid case: the first step is judged against its own truth, and the second never runs."""
    case = Case(seq_lens=(20, 0, 13), packed=True, num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    backend = registry.get("hostile_nan_state_at_step_one")
    findings = run_check(get_check("steps"), case, backend, torch.device("cpu"))
    assert {f.backend for f in findings} == {backend.name}
    failed = [f for f in findings if f.failed]
    assert [f.tensor for f in failed] == ["final_state"] and "non-finite" in failed[0].problems[0]
    assert failed[0].first_bad is not None and all("step 1" in f.subject for f in findings)


def test_repro_minimize_and_checks_charge_a_backend_that_exits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    case = ["--case", CASES[0].to_json(), "--device", "cpu", "--plugin", "kda_hostile", "--out", str(tmp_path)]
    assert main(["repro", "--backend", "hostile_os_exit", "--check", "budget", *case]) == ERRORED
    assert "called os._exit(0) during its call" in capsys.readouterr().out
    assert main(["minimize", "--backend", "hostile_system_exit", "--budget-s", "10", *case]) == ERRORED
    assert "still error" in capsys.readouterr().out
    checks = ["checks", "--run", "--backend", "hostile_returns_none", *case]
    assert main(checks) == ERRORED
    assert "returned NoneType, not a BackendOutput" in capsys.readouterr().out


def _dead(command: list[str], out: Path, timeout: float = 600) -> tuple[subprocess.CompletedProcess, pd.DataFrame]:
    env = {"PYTHONPATH": str(PLUGINS), "PATH": "/usr/bin:/bin", "HOME": str(out)}
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)
    return done, load_store(out).records


@pytest.mark.parametrize("dying", ["planted_segfault", "hostile_abort"])
def test_a_process_that_dies_in_a_call_leaves_the_calls_error_and_a_nonzero_exit(dying: str, tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "kda_conformance.cli", "run", "--device", "cpu", "--plugin", "kda_hostile"]
    cli += ["--plugin", "kda_planted_crashes"]
    done, records = _dead(
        [*cli, "--backend", "torch_chunk", "--backend", dying, *CASE_ARGS, "--out", str(tmp_path)], tmp_path
    )
    assert done.returncode < 0, done.stderr[-2000:]  # killed by its signal
    died = records[records["backend"] == dying]
    assert list(died["verdict"]) == ["error"] and "the process ended during" in died["reason"].iloc[0]
    assert set(records[records["backend"] == "torch_chunk"]["verdict"]) == {"pass"}
    assert main(["dashboard", "--store", str(tmp_path)]) == 0


def test_a_single_pytest_process_that_dies_in_a_call_leaves_its_row(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "pytest", "-q", "conformance/test_corpus.py", "-k", "kda-7735f63ee3cc"]
    command += ["--kda-device", "cpu", "--kda-plugin", "kda_hostile", "--kda-backend", "hostile_abort"]
    done, records = _dead([*command, "--kda-out", str(tmp_path)], tmp_path)
    assert done.returncode != 0
    assert list(records["verdict"]) == ["error"] and list(records["backend"]) == ["hostile_abort"]
    test = records["test"].iloc[0]
    assert "test_corpus_case[hostile_abort-" in test and test.endswith("-kda-7735f63ee3cc]")


def test_pytest_records_a_hostile_backends_errors_and_exits_nonzero(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "pytest", "-q", "conformance/test_corpus.py", "-k", "kda-7735f63ee3cc"]
    command += ["--kda-device", "cpu", "--kda-plugin", "kda_hostile", "--kda-out", str(tmp_path)]
    for name in ("hostile_system_exit", "hostile_raises_in_availability", "torch_chunk"):
        command += ["--kda-backend", name]
    done, records = _dead(command, tmp_path)
    assert done.returncode == 1, done.stdout[-3000:]
    assert verdicts(records, "torch_chunk") and set(records[records["backend"] == "torch_chunk"]["verdict"]) == {"pass"}
    for name in ("hostile_system_exit", "hostile_raises_in_availability"):
        assert list(records[records["backend"] == name]["verdict"]) == ["error"], records


@pytest.fixture
def loose_baseline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    yield
    registry.register("torch_chunk", TorchChunk, replace=True)  # the rest of this process keeps the suite's
    sys.modules.pop("kda_hostile_baseline", None)


def test_a_replaced_baseline_is_recorded_and_shown(
    loose_baseline: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_into(tmp_path, "torch_chunk", plugin="kda_hostile_baseline") == 0
    out = capsys.readouterr().out
    assert "warning: the baseline torch_chunk is kda_hostile_baseline.LooseBaseline" in out
    records = load_store(tmp_path).records
    assert set(records["env_baseline"]) == {"kda_hostile_baseline.LooseBaseline"}
    assert (
        "its limits come from a replaced baseline (kda_hostile_baseline.LooseBaseline)"
        in (tmp_path / "dashboard.html").read_text()
    )


@pytest.mark.slow
def test_a_worker_that_dies_in_a_call_leaves_its_row_in_the_merged_run(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "pytest", "-q", "-n", "2", "conformance/test_corpus.py", "-k", "kda-7735f63ee3cc"]
    command += ["--kda-device", "cpu", "--kda-plugin", "kda_planted_crashes", "--kda-out", str(tmp_path)]
    command += ["--kda-backend", "planted_segfault", "--kda-backend", "torch_chunk"]
    done, records = _dead(command, tmp_path)
    assert done.returncode == 1, done.stdout[-3000:]
    died = records[records["backend"] == "planted_segfault"]
    assert list(died["verdict"]) == ["error"] and "the process ended during" in died["reason"].iloc[0]
    assert list(records[records["backend"] == "torch_chunk"]["verdict"]) == ["pass", "pass"]
    assert len(load_store(tmp_path).runs) == 1


# What a record says of a call, whichever command made it.
SAID = ["check", "case_id", "backend", "tensor", "verdict", "reason", "observed", "first_bad", "known_issue", "max_abs"]


def _budget_rows(out: Path, case: Case) -> list[dict]:
    records = load_store(out).records
    rows = records[(records["check"] == "budget") & (records["case_id"] == case.id)]
    return rows[SAID].astype(object).fillna("").astype(str).sort_values("tensor").to_dict("records")


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend", ["hostile_writes_q", "hostile_os_exit", "hostile_raises_in_supports", "hostile_abort"]
)
def test_repro_minimize_and_checks_record_what_the_sweep_records(backend: str, tmp_path: Path) -> None:
    """One executor: the budget check of a backend that breaks its call contract, calls os._exit, raises where
    it must answer or kills its process gives the same verdict and the same record (its journal row, for the
    process that died) through `run`, `repro`, `minimize` and `checks --run`."""
    case = CASES[0]
    common = ["--device", "cpu", "--plugin", "kda_hostile", "--backend", backend, "--case", case.to_json()]
    commands = {
        "run": ["run", *common, "--no-dashboard"],
        "repro": ["repro", "--check", "budget", *common],
        "minimize": ["minimize", "--budget-s", "1", *common],
        "checks": ["checks", "--run", *common],
    }
    rows = {}
    for name, command in commands.items():
        out = tmp_path / name
        if backend == "hostile_abort":  # the process dies in the call: its journal row is all there is
            done, _ = _dead([sys.executable, "-m", "kda_conformance.cli", *command, "--out", str(out)], out)
            assert done.returncode < 0, (name, done.stdout[-2000:], done.stderr[-2000:])
        else:
            main([*command, "--out", str(out)])
        rows[name] = _budget_rows(out, case)
    assert rows["run"], rows
    for name in ("repro", "minimize", "checks"):
        assert rows[name] == rows["run"], (name, rows[name], rows["run"])


@pytest.mark.slow
@pytest.mark.parametrize("isolate", [False, True], ids=["in-process", "isolated"])
def test_backends_that_fork_pass_once_each_and_the_run_exits(isolate: bool, tmp_path: Path) -> None:
    """A forked child is the backend's: it ends with the call, writes no row and is no second sweep."""
    import kda_hostile

    cli = [sys.executable, "-m", "kda_conformance.cli", "run", "--device", "cpu", "--plugin", "kda_hostile"]
    cli += ["--isolate"] if isolate else ["--no-isolate"]
    cli += [arg for name in ("torch_chunk", *kda_hostile.FORKING) for arg in ("--backend", name)]
    # The old code never ended: a child went on as a second sweep.
    done, records = _dead([*cli, *CASE_ARGS, "--out", str(tmp_path), "--no-dashboard"], tmp_path, timeout=180)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert set(records["verdict"]) == {"pass"}, records[["backend", "verdict", "reason"]]
    assert not records.duplicated(["check", "case_id", "backend", "tensor"]).any()
    rows = records.groupby("backend").size()
    assert set(rows.index) == {"torch_chunk", *kda_hostile.FORKING} and rows.nunique() == 1, rows
    assert len(load_store(tmp_path).runs) == 1
