"""The call ends when it returns (issue 51, item 3): threads and children a backend leaves running are its
failure, what they do later is charged to it and moves no other verdict, and the front ends exit whatever
they do (tests/plugins/kda_left_work.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from suite_paths import PLUGINS, REPO

from kda_cases.case import Case
from kda_cases.materialize import materialize
from kda_conformance.cli import main
from kda_conformance.cli.exits import FAILED
from kda_kernels import guard, left_work, registry
from kda_kernels.guard import raised_by
from kda_kernels.torch_chunk import TorchChunk
from kda_reports.findings import SUITE_BACKEND
from kda_reports.store import load_store

CPU = torch.device("cpu")
CASE = Case(seq_lens=(37,), initial_state="random", num_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16)
OTHER = Case(seq_lens=(20, 0, 13), packed=True, num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=32)


def _wait_for_left_threads() -> None:
    """Until the plugin's threads have done what they do (joined, not slept on: a loaded machine is slow)."""
    for thread in threading.enumerate():
        if thread.name in ("left-later", "quick"):
            thread.join()


@pytest.fixture(autouse=True)
def plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    monkeypatch.syspath_prepend(str(PLUGINS))
    import kda_left_work

    guard.take_breaches()
    yield kda_left_work
    _wait_for_left_threads()
    guard.run_backend_call(TorchChunk(), materialize(OTHER, CPU))  # proves the world, forgets the ended
    guard.take_breaches()
    assert not left_work.owners()


def test_a_thread_that_ends_within_the_grace_is_part_of_the_call(plugin) -> None:
    guard.run_backend_call(registry.get("left_thread_that_ends"), materialize(CASE, CPU))
    assert guard.take_breaches() == []
    writer = registry.get("left_writes_q_later")
    inputs = materialize(CASE, CPU)
    q = inputs.q.clone()
    guard.run_backend_call(writer, inputs)  # its thread writes 0.05 s after the return: still its call
    [wrote] = guard.take_breaches()
    assert str(wrote).startswith("left_writes_q_later wrote into its input q: first changed element")
    assert not wrote.late and torch.equal(inputs.q, q)


def test_a_write_a_left_thread_makes_later_is_charged_to_its_backend_not_the_next(
    plugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(left_work, "GRACE", 0.05)
    monkeypatch.setattr(plugin, "DELAY", 0.3)
    inputs = materialize(CASE, CPU)
    clean = guard.run_backend_call(TorchChunk(), inputs)
    writer = registry.get("left_writes_q_later")
    guard.run_backend_call(writer, inputs)
    [left] = guard.take_breaches()
    assert "left 1 thread ('left-later' (daemon)) running 0.05 s after its call returned" in str(left)
    _wait_for_left_threads()  # the thread writes into q now, between two calls
    result = guard.run_backend_call(TorchChunk(), inputs)
    [late] = guard.take_breaches()
    assert raised_by(late) == writer.name and late.late
    assert "wrote into its input q, after its call had returned: a thread it left running" in str(late)
    assert torch.equal(result.o, clean.o) and torch.equal(result.final_state, clean.final_state)


def test_a_write_landing_between_the_kept_proof_and_the_calls_own_is_not_the_calls(
    plugin, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """The race a loaded CI machine once hit: the left thread wrote into q after the copies its call was
    handed had been compared and before the next call's own were, and that call was charged with the write."""
    monkeypatch.setattr(left_work, "GRACE", 0.05)
    proof, armed, release = guard._check_kept, threading.Event(), threading.Event()
    # The left thread waits without writing until the test ends: the test makes its write, in the window.
    left = lambda work: threading.Thread(target=release.wait, name="left-later", daemon=True).start()  # noqa: E731
    monkeypatch.setattr(plugin, "_later", left)
    request.addfinalizer(release.set)  # before the plugin fixture joins the left threads

    def proved_then_written(when: str) -> object:
        proved = proof(when)
        if armed.is_set() and when.startswith("found after"):
            armed.clear()
            inputs.q.view(-1)[-1:].add_(1)
        return proved

    # Replaced before the calls: the world each call starts from has it (a change between calls is a breach).
    monkeypatch.setattr(guard, "_check_kept", proved_then_written)
    inputs = materialize(CASE, CPU)
    writer = registry.get("left_writes_q_later")
    guard.run_backend_call(writer, inputs)
    assert "left 1 thread" in str(guard.take_breaches()[0])
    armed.set()
    guard.run_backend_call(TorchChunk(), inputs)
    assert guard.take_breaches() == []
    guard.run_backend_call(TorchChunk(), materialize(OTHER, CPU))
    [late] = guard.take_breaches()
    assert raised_by(late) == writer.name and late.late and "wrote into its input q" in str(late)
    assert torch.equal(inputs.q, materialize(CASE, CPU).q)
    left_work.forget(list(left_work._threads_left))
    guard._forget([])


def test_a_setting_a_left_thread_changes_later_is_put_back_and_charged_to_its_backend(
    plugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(left_work, "GRACE", 0.05)
    monkeypatch.setattr(plugin, "DELAY", 0.3)
    setter = registry.get("left_sets_dtype_later")
    guard.run_backend_call(setter, materialize(CASE, CPU))
    assert "left 1 thread" in str(guard.take_breaches()[0])
    _wait_for_left_threads()
    guard.run_backend_call(TorchChunk(), materialize(CASE, CPU))
    [late] = guard.take_breaches()
    assert raised_by(late) == setter.name and torch.get_default_dtype() == torch.float32
    assert "changed torch's default dtype from torch.float32 to torch.float64 (put back), after its call" in str(late)


def test_a_left_thread_moves_no_other_backends_verdict_in_a_run(
    plugin, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(left_work, "GRACE", 0.05)
    monkeypatch.setattr(plugin, "DELAY", 0.1)
    cases = [arg for case in (CASE, OTHER) for arg in ("--case", case.to_json())]
    common = ["run", "--device", "cpu", "--plugin", "kda_left_work", *cases]

    def verdicts(out: Path, backend: str) -> dict:
        records = load_store(out).records
        assert SUITE_BACKEND not in set(records["backend"])
        mine = records[records["backend"] == backend]
        return {(r.case_id, r.tensor): r.verdict for r in mine.itertuples()}

    assert main([*common, "--backend", "torch_chunk", "--out", str(tmp_path / "alone")]) == 0
    alone = verdicts(tmp_path / "alone", "torch_chunk")
    for backend in ("left_writes_q_later", "left_sets_dtype_later"):
        out = tmp_path / backend
        assert main([*common, "--backend", backend, "--backend", "torch_chunk", "--out", str(out)]) == FAILED
        records = load_store(out).records
        mine = records[records["backend"] == "torch_chunk"]
        assert not mine["reason"].str.contains("wrote into|changed torch", regex=True).any(), mine["reason"]
        if backend == "left_sets_dtype_later":  # a setting is proved at every call's start: no call saw it
            assert verdicts(out, "torch_chunk") == alone, backend
        # (A write into q landing between a proof and the next call's snapshot, a window of microseconds, would
        # be computed on by that call: charged to the writer, but that call's numbers would move.)
        assert set(verdicts(out, backend).values()) >= {"fail"}


def _cli(args: list[str], out: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(PLUGINS), "PATH": os.environ["PATH"], "HOME": str(out)}
    # Pipes, as a CI job reads a command's output: a child left holding them would keep this waiting.
    return subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)


@pytest.mark.slow
def test_run_ends_and_kills_the_children_whatever_a_backend_left_running(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "kda_conformance.cli", "run", "--device", "cpu", "--plugin", "kda_left_work"]
    backends = ["--backend", "left_thread_forever", "--backend", "left_child_holding_stdout"]
    backends += ["--backend", "torch_chunk"]
    done = _cli([*cli, *backends, "--case", CASE.to_json(), "--out", str(tmp_path)], tmp_path)
    assert done.returncode == FAILED, done.stdout[-2000:] + done.stderr[-2000:]
    records = load_store(tmp_path).records
    reasons = " ".join(records["reason"])
    assert "left_thread_forever" in set(records[records["verdict"] == "fail"]["backend"])
    assert "left 1 thread ('forever') running" in reasons
    [pid] = re.findall(r"left 1 child process \((\d+) \(sleep\)\)", reasons)
    assert left_work._state(int(pid)) in ("", "Z", "X")  # killed when the run ended
    assert set(records[records["backend"] == "torch_chunk"]["verdict"]) == {"pass"}


@pytest.mark.slow
def test_a_pytest_session_ends_whatever_thread_a_backend_left_running(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "conformance/test_corpus.py"]
    command += ["-k", "kda-7735f63ee3cc", "--kda-device", "cpu", "--kda-plugin", "kda_left_work"]
    done = _cli([*command, "--kda-backend", "left_thread_forever", "--kda-out", str(tmp_path)], tmp_path)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "left 1 thread ('forever') running" in " ".join(load_store(tmp_path).records["reason"])


def test_a_backend_that_closes_stdout_leaves_the_run_its_output(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "kda_conformance.cli", "run", "--device", "cpu", "--plugin", "kda_hostile"]
    backends = ["--backend", "hostile_closes_stdout", "--backend", "torch_chunk"]
    done = _cli([*cli, *backends, "--case", CASE.to_json(), "--out", str(tmp_path)], tmp_path)
    assert done.returncode == FAILED, done.stdout[-2000:] + done.stderr[-2000:]
    assert "records:" in done.stdout and "dashboard:" in done.stdout  # printed after the backend closed it
    records = load_store(tmp_path).records
    closed = records[(records["backend"] == "hostile_closes_stdout") & (records["verdict"] == "fail")]
    assert closed["reason"].str.contains("closed sys.stdout (a fresh one on its file descriptor", regex=False).any()
    assert set(records[records["backend"] == "torch_chunk"]["verdict"]) == {"pass"}
