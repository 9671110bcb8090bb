"""Exit codes say the truth: one table of them (docs/exit-codes.md), and the commands that ran nothing, or
ran into a backend that cannot run, say so instead of passing."""

from __future__ import annotations

from pathlib import Path

import pytest
from suite_paths import PLUGINS

from kda_conformance.cli import build_parser, main, nightly
from kda_conformance.cli.exits import ERRORED, FAILED, MEANINGS, NOT_CHECKED, NOTHING_RAN, PASSED, verdict_exit

DOCS = Path(__file__).resolve().parent.parent / "docs" / "exit-codes.md"
CASE = '{"seq_lens": [9], "num_heads": 1, "num_v_heads": 1, "head_k_dim": 16, "head_v_dim": 16}'


def ledger_of(monkeypatch: pytest.MonkeyPatch, **fields: object) -> None:
    """The ledger, for one test, of one entry with these fields (the others a test needs not say)."""
    from kda_conformance.judging import known

    entry = known.KnownIssue(**{"upstream": "nowhere", "added": "2026-12-01", "confirmed": "by hand", **fields})
    monkeypatch.setattr(known, "ledger", lambda: (entry,))


def test_the_documented_table_is_the_codes() -> None:
    documented = DOCS.read_text()
    for code, meaning in MEANINGS.items():
        assert f"| {code} | {meaning} |" in documented, code


@pytest.mark.parametrize(
    ("verdicts", "strict", "code"),
    [
        (["pass", "known"], False, PASSED),
        (["pass", "warn"], False, PASSED),
        (["pass", "warn"], True, FAILED),
        (["error", "fail"], False, FAILED),
        (["error", "pass"], False, ERRORED),
        (["skip", "resource"], False, NOT_CHECKED),
        # A case out of memory beside passing ones was exit 0: a kernel never judged there passed CI.
        (["pass", "resource"], False, NOT_CHECKED),
        (["error", "resource"], False, ERRORED),
        ([], False, NOTHING_RAN),
    ],
)
def test_a_failure_outranks_an_error_which_outranks_nothing_ran(
    verdicts: list, strict: bool, code: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KDA_ACCEPT_RESOURCE", raising=False)
    assert verdict_exit(verdicts, strict) == code


def test_an_accepted_resource_verdict_counts_as_a_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KDA_ACCEPT_RESOURCE", "1")
    assert verdict_exit(["pass", "resource"]) == PASSED and verdict_exit(["resource"]) == NOTHING_RAN


def test_repro_of_a_backend_that_cannot_run_here_is_nothing_ran_not_a_pass(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))
    argv = ["repro", "--plugin", "kda_unavailable", "--backend", "needs_an_accelerator", "--device", "cpu"]
    assert main([*argv, "--check", "budget", "--case", CASE]) == NOTHING_RAN
    assert "nothing ran: needs_an_accelerator does not run this case" in capsys.readouterr().out
    split = ["repro", "--backend", "torch_chunk", "--device", "cpu", "--check", "split_resume", "--at", "40"]
    assert main([*split, "--case", CASE]) == NOTHING_RAN  # the split point lies outside the case
    assert "check split_resume does not apply: split point p=40" in capsys.readouterr().out


def test_repro_of_a_known_failure_says_it_failed_as_known_not_that_it_passes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """AITER's zero-length member on an H100 (2026-12-06): 49664 non-finite outputs, known to the ledger, and
    repro said "no finding: check budget passes on this case". It exits as a pass, saying which entry it is."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    backend = "planted_no_decay_at_chunk_boundary"
    ledger_of(monkeypatch, id="planted-on-cpu", backends=(backend,), description="a planted bug", worst=1e6)
    case = '{"seq_lens": [130], "num_heads": 1, "num_v_heads": 1, "head_k_dim": 16, "head_v_dim": 16}'
    argv = ["repro", "--plugin", "kda_planted_bugs", "--backend", backend, "--device", "cpu", "--check", "budget"]
    assert main([*argv, "--case", case]) == PASSED
    said = " ".join(capsys.readouterr().out.split())
    assert "known issue: check budget fails on this case as the ledger's planted-on-cpu (not a new finding)" in said
    assert "passes on this case" not in said


def test_the_nightly_passes_strict_mode_to_its_workers() -> None:
    args = build_parser().parse_args(["nightly", "--store", "s", "--strict"])
    assert "--kda-strict" in nightly.pytest_command(args, "night")


def test_a_known_issue_that_no_longer_reproduces_is_a_warning_and_fails_under_strict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger_of(monkeypatch, id="gone-on-cpu", backends=("torch_chunk",), description="a problem since fixed", worst=10.0)
    argv = ["run", "--device", "cpu", "--backend", "torch_chunk", "--case", CASE]
    assert main([*argv, "--out", str(tmp_path / "a")]) == PASSED
    said = capsys.readouterr().out
    assert "warn: known issue gone-on-cpu no longer reproduces: all 1 cases it matched passed on torch_chunk" in said
    assert main([*argv, "--strict", "--out", str(tmp_path / "b")]) == FAILED
    page = (tmp_path / "b" / "dashboard.html").read_text()
    assert "gone-on-cpu" in page.split("Known issues that no longer reproduce")[1].split("<h2>")[0]


def test_every_command_and_every_code_it_returns_is_in_the_docs() -> None:
    """Every command has a row in the per-command table, and every literal code a command module returns
    (``return N``, ``sys.exit(N)``, or one of exits.py's names) is a documented one."""
    import ast

    from kda_conformance.cli import COMMANDS, exits
    from kda_conformance.running.faults import DEVICE_LOST_EXIT

    documented = DOCS.read_text()
    table = documented.split("## Per command", 1)[1]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    for command in COMMANDS:
        assert any(f"`{command.name}" in row for row in rows), f"{command.name} has no row in docs/exit-codes.md"
    codes = {name: value for name, value in vars(exits).items() if isinstance(value, int) and name.isupper()}
    allowed = set(MEANINGS) | {DEVICE_LOST_EXIT}
    assert f"exit {DEVICE_LOST_EXIT}" in documented
    for command in COMMANDS:
        tree = ast.parse(Path(command.module.__file__).read_text())
        for node in ast.walk(tree):
            value = getattr(node, "value", None) if isinstance(node, ast.Return) else None
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "exit" and node.args:
                value = node.args[0]
            if isinstance(value, ast.Constant) and isinstance(value.value, int) and not isinstance(value.value, bool):
                assert value.value in allowed, f"{command.name} returns {value.value}, not in docs/exit-codes.md"
            if isinstance(value, ast.Name) and value.id in codes:
                assert codes[value.id] in allowed, f"{command.name} returns {value.id}"


def test_an_error_a_ledger_entry_names_by_its_message_is_known(tmp_path: Path, monkeypatch) -> None:
    """FLA's FlashKDA dispatch raising "all tensors must be contiguous" on strided inputs is a known upstream
    problem, not an error of the night; another message of the same backend stays an error."""
    from kda_reports.store import load_store

    ledger_of(monkeypatch, id="raises-on-cpu", backends=("planted_raises",), description="a backend that raises",
              worst=1.0, raises=("planted message",))  # fmt: skip
    argv = ["run", "--device", "cpu", "--plugin", "kda_planted_crashes", "--backend", "planted_raises", "--case", CASE]
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setenv("KDA_PLANTED_MESSAGE", "a planted message from the kernel")
    assert main([*argv, "--out", str(tmp_path / "a")]) == PASSED
    (row,) = load_store(tmp_path / "a").records.to_dict("records")
    assert row["verdict"] == "known" and row["known_issue"] == "raises-on-cpu"
    assert row["reason"].startswith("known issue raises-on-cpu: ") and "planted message" in row["reason"]
    monkeypatch.setenv("KDA_PLANTED_MESSAGE", "another failure")
    assert main([*argv, "--out", str(tmp_path / "b")]) == ERRORED


def test_repro_of_a_gpu_only_check_on_the_cpu_runs_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """host_syncs measures CUDA's sync debug mode: on the CPU it raised "Torch not compiled with CUDA enabled",
    charged to the suite, where its pytest test skips."""
    case = '{"seq_lens": [20], "num_heads": 1, "num_v_heads": 1, "head_k_dim": 16, "head_v_dim": 16}'
    argv = ["repro", "--device", "cpu", "--backend", "torch_chunk", "--check", "host_syncs", "--case", case]
    assert main([*argv, "--out", str(tmp_path)]) == NOTHING_RAN
    assert "check host_syncs runs on cuda only, not cpu" in capsys.readouterr().out
