"""Triage (``kda-conformance triage``): each untriaged finding's smallest case rerun as it failed, then with one
switch at a time; the switch under which it passes is named as its cause, and every rerun is kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from suite_paths import ENV, PLUGINS

from kda_cases.case import Case
from kda_conformance.cli import build_parser, main
from kda_conformance.repro.triage import SWITCHES, Rerun, Triage, parse_repro, triage
from kda_kernels import registry


@pytest.fixture
def plugins(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    return ["--plugin", "kda_triage", "--plugin", "kda_planted_bugs"]


@pytest.mark.slow
def test_triage_names_the_switch_that_clears_a_tf32_error_and_an_empty_member_bug(
    tmp_path: Path, plugins: list[str]
) -> None:
    store = tmp_path / "store"
    fp32 = Case(seq_lens=(40,), dtype="fp32", num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    packed = Case(seq_lens=(20, 0, 17), packed=True, initial_state="random", num_heads=1, num_v_heads=1,
                  head_k_dim=16, head_v_dim=16)  # fmt: skip
    for backend, case in (("triage_tf32_unless_ieee", fp32), ("planted_zero_length_shifts_sequences", packed)):
        argv = ["run", "--device", "cpu", *plugins, "--backend", backend, "--case", case.to_json()]
        assert main([*argv, "--out", str(store), "--no-dashboard", "--redraws", "0"]) == 1
    assert main(["triage", "--store", str(store), *plugins, "--jobs", "3"]) == 0
    written = json.loads((store / "triage" / "triage.json").read_text())
    # Smallest case first: the packed case's 37 tokens before the fp32 case's 40.
    assert [r["backend"] for r in written] == ["planted_zero_length_shifts_sequences", "triage_tf32_unless_ieee"]
    results = {r["backend"]: r for r in written}
    tf32 = results["triage_tf32_unless_ieee"]
    assert tf32["cause"] == "IEEE dots", tf32
    outcomes = {r["switch"]: r["outcome"] for r in tf32["reruns"]}
    assert outcomes["as it failed"] == "fails" and outcomes["zero-length members removed"].startswith("n/a")
    ieee = next(r for r in tf32["reruns"] if r["switch"] == "IEEE dots")
    assert ieee["command"].startswith("TRITON_F32_DEFAULT=ieee KDA_LEDGER='' kda-conformance run") and ieee["exit"] == 0
    empty = results["planted_zero_length_shifts_sequences"]
    assert empty["cause"] == "zero-length members removed", empty
    page = (store / "triage" / "triage.md").read_text()
    assert "| IEEE dots |" in page and "zero-length members removed |" in page
    # The findings page shows each new finding's cause as triage found it.
    findings = tmp_path / "findings.md"
    argv = ["findings", "--store", str(store), *plugins, "--triage", str(store / "triage" / "triage.json")]
    assert main([*argv, "--page", str(findings)]) == 0
    rows = [line for line in findings.read_text().splitlines() if line.startswith("| [")]
    causes = {row.split(" | ")[11] for row in rows if "| new |" in row}
    assert causes == {"IEEE dots (triage/triage.json)", "zero-length members removed (triage/triage.json)"}, rows


def test_a_repro_line_reads_back_as_the_rerun_it_names(plugins: list[str]) -> None:
    registry.load_plugin("kda_triage")  # as the rerun has it loaded: its line names it by its file
    case = Case(seq_lens=(30,), head_k_dim=16, head_v_dim=16)
    line = "kda-conformance repro --device cpu --plugin kda_triage --backend triage_tf32_unless_ieee --at 7 "
    line += f"--check split_resume --case '{case.to_json()}'"
    # The line's plugins are read, never loaded on its say-so: the rerun takes the command line's.
    assert parse_repro(line, build_parser()).missing_plugins == ("kda_triage",)
    r = parse_repro(line, build_parser(), ["kda_triage"])
    assert (r.check, r.backend, r.params, r.plugins, r.case, r.missing_plugins) == (
        "split_resume", "triage_tf32_unless_ieee", {"at": 7}, ("kda_triage",), case, ()
    )  # fmt: skip
    triage_file = (PLUGINS / "kda_triage.py").resolve()  # a module found on sys.path, named by its file
    assert r.line().startswith(f"kda-conformance repro --device cpu --plugin {triage_file} --backend triage_tf32")
    assert set(SWITCHES) == {"IEEE dots", "zero-length members removed", "contiguous inputs",
                             "a fresh cu_seqlens tensor", "another chunk size", "an fp32 state"}  # fmt: skip


def test_a_process_killed_in_the_call_reproduces_and_a_switch_can_clear_it(tmp_path: Path, plugins: list[str]) -> None:
    # FlashKDA's abort on 64 one-token sequences was first read as "does not reproduce here (it exit -6)".
    registry.load_plugin("kda_triage")
    case = Case(seq_lens=(20, 0, 17), packed=True, num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    line = f"kda-conformance run --device cpu --backend triage_aborts_on_empty_member --case '{case.to_json()}'"
    result = triage("f-1", line, build_parser(), tmp_path, plugins=["kda_triage"], jobs=3)
    outcomes = {r.switch: r.outcome for r in result.reruns}
    assert outcomes["as it failed"] == "dies of SIGABRT" and result.reproduces, outcomes
    assert outcomes["zero-length members removed"] == "passes", outcomes
    assert result.cause == "zero-length members removed"


def test_a_finding_the_ledger_knows_is_triaged_as_it_fails_not_as_a_pass(
    tmp_path: Path, plugins: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an H100, `triage --finding fla-bwd-intra-tf32-parameter-gradients` read "does not reproduce here (it
    passes)": a failure the ledger knows exits 0, as a pass does. Each rerun runs with the ledger off."""
    ledger = tmp_path / "ledger.toml"
    ledger.write_text(
        '[[issue]]\nid = "tf32-known"\nbackends = ["triage_tf32_unless_ieee"]\ndescription = "d"\n'
        'upstream = "u"\nadded = "2026-12-07"\nworst = 1e9\nconfirmed = "c"\n'
        '[[issue.links]]\nkind = "none"\nref = "r"\nstatus = "s"\n'
    )
    monkeypatch.setenv("KDA_LEDGER", str(ledger))
    registry.load_plugin("kda_triage")
    case = Case(seq_lens=(40,), dtype="fp32", num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    line = f"kda-conformance run --device cpu --backend triage_tf32_unless_ieee --case '{case.to_json()}'"
    argv = ["run", "--device", "cpu", *plugins, "--backend", "triage_tf32_unless_ieee", "--case", case.to_json()]
    assert main([*argv, "--out", str(tmp_path / "known"), "--no-dashboard", "--redraws", "0"]) == 0  # known
    result = triage("tf32-known", line, build_parser(), tmp_path, plugins=["kda_triage"], jobs=2)
    outcomes = {r.switch: r.outcome for r in result.reruns}
    assert outcomes["as it failed"] == "fails" and result.cause == "IEEE dots", outcomes
    assert result.reruns[0].command.startswith("KDA_LEDGER='' kda-conformance run")


def test_a_ledger_the_environment_names_must_be_readable(tmp_path: Path) -> None:
    case = Case(seq_lens=(9,), num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16).to_json()
    argv = ["repro", "--device", "cpu", "--backend", "torch_chunk", "--check", "budget", "--case", case]
    env = {**ENV, "KDA_LEDGER": str(tmp_path / "nowhere.toml")}
    done = subprocess.run([sys.executable, "-m", "kda_conformance.cli", *argv], capture_output=True, text=True, env=env)
    assert done.returncode == 2 and "KDA_LEDGER: " in done.stdout + done.stderr, done.stdout + done.stderr
    assert "nowhere.toml" in done.stdout + done.stderr and "Traceback" not in done.stderr


def test_a_finding_that_does_not_fail_here_runs_no_switch(tmp_path: Path, plugins: list[str]) -> None:
    case = Case(seq_lens=(37,), num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    line = f"kda-conformance run --device cpu --backend torch_chunk --case '{case.to_json()}'"
    result = triage("f-1", line, build_parser(), tmp_path)
    assert [r.outcome for r in result.reruns[:1]] == ["passes"]
    assert {r.outcome for r in result.reruns[1:]} == {"n/a (it passes as it failed)"}
    assert result.cause == "does not reproduce here (it passes)"


def test_switches_run_beside_the_first_rerun_count_only_where_it_fails(tmp_path: Path, plugins: list[str]) -> None:
    case = Case(seq_lens=(20, 0, 17), packed=True, num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    line = f"kda-conformance run --device cpu --backend torch_chunk --case '{case.to_json()}'"
    result = triage("f-1", line, build_parser(), tmp_path, jobs=7)
    # The zero-length switch applies and ran beside the first rerun; the case passes, so it does not count.
    assert [r.outcome for r in result.reruns] == ["passes"] + ["n/a (it passes as it failed)"] * len(SWITCHES)
    assert result.cause == "does not reproduce here (it passes)"


def test_a_rerun_past_its_timeout_is_recorded_as_stopped(tmp_path: Path, plugins: list[str]) -> None:
    case = Case(seq_lens=(37,), num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    line = f"kda-conformance run --device cpu --backend torch_chunk --case '{case.to_json()}'"
    result = triage("f-1", line, build_parser(), tmp_path, timeout=0.01)
    assert result.reruns[0].outcome == "stopped after 0.01 s" and result.cause.startswith("not established (as it")
    # A rerun stopped is stopped with its children (an --isolate worker holding the GPU), on time.
    registry.load_plugin("kda_triage")
    line = f"kda-conformance run --device cpu --backend triage_hangs_with_a_child --case '{case.to_json()}'"
    pid_file = tmp_path / "child.pid"
    env = {**os.environ, "KDA_TEST_CHILD_PID": str(pid_file)}
    started = time.monotonic()
    result = triage("f-2", line, build_parser(), tmp_path, env=env, plugins=["kda_triage"], timeout=8)
    assert result.reruns[0].outcome == "stopped after 8 s" and time.monotonic() - started < 30
    child = int(pid_file.read_text())
    for _ in range(50):  # the orphan is reaped by init once killed
        if not Path(f"/proc/{child}").exists():
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{child}").exists(), "the rerun's child outlived it"
    with pytest.raises(SystemExit) as refused:
        main(["triage", "--store", str(tmp_path), "--rerun-timeout", "0"])
    assert refused.value.code == 2


def test_no_switch_clears_it_only_when_every_switch_that_applies_ran_to_its_end() -> None:
    """On an H100 (night-1217) a graph-replay finding's IEEE-dots rerun was stopped after 12 s, the call's time
    running out, and the cause read "no single switch clears it": that switch had not said."""
    failed = Rerun("as it failed", exit=1)
    stopped = Rerun("IEEE dots", exit=None, timed_out=12.0)
    not_applied = Rerun("zero-length members removed", not_applied="no zero-length member")
    cut = Triage("f", "aiter_flashkda", "graph_replay", "kda-1", (failed, stopped, not_applied))
    assert cut.cause == "not established (no switch that ran clears it; IEEE dots stopped after 12 s)"
    ran = Triage("f", "aiter_flashkda", "graph_replay", "kda-1", (failed, Rerun("IEEE dots", exit=1), not_applied))
    assert ran.cause == "not established (no single switch clears it)"
    cleared = Triage("f", "aiter_flashkda", "graph_replay", "kda-1", (failed, stopped, Rerun("an fp32 state", exit=0)))
    assert cleared.cause == "an fp32 state"


def test_every_rerun_gets_the_autotune_choices_it_is_told_to_replay(
    tmp_path: Path, plugins: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--autotune-replay FILE`` reaches every rerun's environment (KDA_AUTOTUNE_REPLAY) and the page says so; a
    path that is neither a file nor a folder is refused by name."""
    import kda_conformance.cli.triage as triage_cli
    from kda_conformance.repro.triage import Triage

    store = tmp_path / "store"
    packed = Case(seq_lens=(20, 0, 17), packed=True, initial_state="random", num_heads=1, num_v_heads=1,
                  head_k_dim=16, head_v_dim=16)  # fmt: skip
    argv = ["run", "--device", "cpu", *plugins, "--backend", "planted_zero_length_shifts_sequences"]
    assert main([*argv, "--case", packed.to_json(), "--out", str(store), "--no-dashboard", "--redraws", "0"]) == 1
    told: list[dict[str, str]] = []

    def rerun(finding_id, repro, parser, out, env=None, **options) -> Triage:
        told.append(dict(env or {}))
        r = parse_repro(repro, parser, options["plugins"])
        return Triage(finding_id, r.backend, r.check, r.case.id, ())

    monkeypatch.setattr(triage_cli, "triage", rerun)
    choices = tmp_path / "choices.json"
    choices.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "triton": "3.6.0", "choices": {}}))
    assert main(["triage", "--store", str(store), *plugins, "--autotune-replay", str(choices)]) == 0
    assert [env.get("KDA_AUTOTUNE_REPLAY") for env in told] == [str(choices.resolve())]
    assert f"every rerun replays the autotune choices of {choices}" in (store / "triage" / "triage.md").read_text()
    assert main(["triage", "--store", str(store), *plugins, "--autotune-replay", str(tmp_path / "none")]) == 2
