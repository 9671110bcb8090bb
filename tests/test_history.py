"""How long a red has been red (reports/history.py, ``kda-conformance history``), on a store of five synthetic
nights: streaks, the last green night, flips, flakiness, and what changed on the first red night."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from kda_conformance.cli import main
from kda_reports.history import cell_history, history_lines
from kda_reports.store import COMPLETE, Store

NIGHTS = ["n1", "n2", "n3", "n4", "n5"]
# Per cell, its verdicts night by night ("" where it did not run).
CELLS = {
    ("fla_chunk", "budget"): ["pass", "pass", "pass", "fail", "fail"],  # red for 2, since n4
    ("fla_chunk", "prefix"): ["pass", "fail", "pass", "fail", "pass"],  # flips 4 times: flaky
    ("aiter_default", "budget"): ["fail", "fail", "fail", "error", "fail"],  # never green
    ("aiter_default", "poison"): ["pass", "", "known", "pass", "pass"],  # green for 4 (a night off skipped)
}


def night_store() -> Store:
    records = [
        {"run_id": night, "backend": backend, "check": check, "verdict": verdict, "env_device_name": "NVIDIA H200"}
        for (backend, check), verdicts in CELLS.items()
        for night, verdict in zip(NIGHTS, verdicts, strict=True)
        if verdict
    ]
    records.append({"run_id": "n5", "backend": "(suite)", "check": "budget", "verdict": "error",
                    "env_device_name": "NVIDIA H200"})  # fmt: skip
    runs = pd.DataFrame(
        {
            "run_id": NIGHTS,
            "status": [COMPLETE] * 5,
            "purpose": ["nightly"] * 5,
            "env_date": [f"2026-12-0{n}" for n in range(1, 6)],
            "env_suite_commit": ["a1", "a1", "b2", "c3", "c3"],
            "env_torch": ["2.11", "2.11", "2.11", "2.12", "2.12"],
            "env_seed": [1, 2, 3, 4, 5],
        }
    )
    return Store(records=pd.DataFrame(records), runs=runs)


def test_five_nights_give_streaks_last_green_flips_and_the_first_red_change() -> None:
    history = cell_history(night_store(), window=10).set_index(["backend", "check"])
    red = history.loc[("fla_chunk", "budget")]
    assert (red.tonight, red.streak, red.last_green, red.flips, red.flaky) == ("red", 2, "n3", 1, False)
    assert red.first_red == "n4" and red.bisect == "b2..c3"
    assert "torch 2.11 -> 2.12" in red.changed and "suite: b2 -> c3" in red.changed
    flaky = history.loc[("fla_chunk", "prefix")]
    assert (flaky.tonight, flaky.streak, flaky.flips, flaky.flaky) == ("green", 1, 4, True)
    never = history.loc[("aiter_default", "budget")]
    assert (never.tonight, never.streak, never.last_green, never.changed) == ("red", 5, "", "")
    quiet = history.loc[("aiter_default", "poison")]
    assert (quiet.tonight, quiet.streak, quiet.flips) == ("green", 4, 0)
    assert "(suite)" not in history.index.get_level_values("backend")
    windowed = cell_history(night_store(), window=3).set_index(["backend", "check"])
    assert windowed.loc[("fla_chunk", "prefix"), "flips"] == 2, "flips counted over the window only"
    lines = history_lines(cell_history(night_store()))
    assert lines[0].startswith("aiter_default / budget / NVIDIA H200: red for 5 nights; last green never")


def test_the_history_command_prints_and_writes_its_table(tmp_path: Path, capsys) -> None:
    store = tmp_path / "store"
    case = '{"seq_lens": [37], "num_heads": 1, "num_v_heads": 1, "head_k_dim": 16, "head_v_dim": 16}'
    for _ in range(2):
        assert main(["run", "--device", "cpu", "--backend", "torch_chunk", "--case", case, "--out", str(store),
                     "--no-dashboard"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["history", "--store", str(store), "--csv", str(tmp_path / "h.csv")]) == 0
    out = capsys.readouterr().out
    assert "torch_chunk / budget / " in out and "green for 2 nights" in out and "1 cells, 0 red tonight" in out
    assert list(pd.read_csv(tmp_path / "h.csv").columns)[:4] == ["backend", "check", "device", "tonight"]
    assert main(["history", "--store", str(tmp_path / "nowhere")]) == 2
    assert main(["dashboard", "--store", str(store)]) == 0
    page = (store / "dashboard.html").read_text()
    assert "History per cell (backend, check, GPU model)" in page and "<td>green</td>" in page


def test_an_expected_status_file_fails_a_cell_that_left_its_status() -> None:
    from kda_reports.history import departures, expected_from

    history = cell_history(night_store())
    expected = pd.DataFrame(
        [
            ["fla_chunk", "budget", "", "green", ""],  # red tonight: it left
            ["aiter_default", "budget", "NVIDIA H200", "red", "chunk-indices-zero-length-member"],  # red, as expected
        ],
        columns=["backend", "check", "device", "expected", "reason"],
    )
    said = departures(history, expected)
    assert said == ["fla_chunk / budget / NVIDIA H200: red, expected green ()"], said
    # Written from tonight, the file expects every cell as it is: no departure.
    assert departures(history, expected_from(history, {("aiter_default", "budget"): "an-entry"})) == []
    rows = expected_from(history, {("aiter_default", "budget"): "an-entry"}).set_index(["backend", "check"])
    assert (
        rows.loc[("aiter_default", "budget"), "reason"] == "an-entry"
        and rows.loc[("fla_chunk", "prefix"), "reason"] == ""
    )


def test_the_history_command_reads_and_updates_the_expected_file(tmp_path: Path, capsys) -> None:
    store = tmp_path / "store"
    case = '{"seq_lens": [37], "num_heads": 1, "num_v_heads": 1, "head_k_dim": 16, "head_v_dim": 16}'
    assert main(["run", "--device", "cpu", "--backend", "torch_chunk", "--case", case, "--out", str(store),
                 "--no-dashboard"]) == 0  # fmt: skip
    expected = tmp_path / "kda-expected.csv"
    expected.write_text("backend,check,device,expected,reason\ntorch_chunk,budget,,red,a reason\n")
    assert main(["history", "--store", str(store), "--expected", str(expected)]) == 1
    assert "torch_chunk / budget / " in capsys.readouterr().out
    assert main(["history", "--store", str(store), "--update-expected", str(expected)]) == 0
    assert main(["history", "--store", str(store), "--expected", str(expected)]) == 0
    assert pd.read_csv(expected, keep_default_na=False).loc[0, "expected"] == "green"
    expected.write_text("backend,check,expected\n")
    assert main(["history", "--store", str(store), "--expected", str(expected)]) == 2


@pytest.mark.slow
def test_a_night_whose_cell_left_its_expected_status_fails(tmp_path: Path) -> None:
    expected = tmp_path / "kda-expected.csv"
    expected.write_text("backend,check,device,expected,reason\ntorch_chunk,budget,,red,a team's reason\n")
    argv = ["nightly", "--store", str(tmp_path / "store"), "--device", "cpu", "--profile", "smoke", "--examples", "1",
            "--backend", "torch_chunk", "--workers", "1", "--expected", str(expected)]  # fmt: skip
    assert main(argv) == 1, "torch_chunk's budget cell is green, the file expects it red"
    # The same night held to a file that expects it as it is passes (without running it again).
    expected.write_text("backend,check,device,expected,reason\n")
    assert main(["history", "--store", str(tmp_path / "store"), "--expected", str(expected)]) == 0
    expected.write_text("backend,check\n")
    assert main(argv) == 2, "a file without its columns is a usage error before the night"


@pytest.mark.slow
def test_pytest_with_an_expected_file_fails_a_cell_that_left_its_status(tmp_path: Path) -> None:
    """pytest's side of nightly --expected: the session's cells against the team's file, named in the summary."""
    from suite_paths import ENV, pytest_run

    expected = tmp_path / "kda-expected.csv"
    expected.write_text("backend,check,device,expected,reason\ntorch_chunk,budget,,red,a team's reason\n")
    argv = ("conformance/test_properties.py", "-k", "test_within_budget", "--kda-device", "cpu", "--kda-backend",
            "torch_chunk", "--kda-profile", "smoke", "--kda-examples", "1",
            "--kda-out", str(tmp_path / "store"))  # fmt: skip
    done = pytest_run(*argv, "--kda-expected", str(expected), env=ENV)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "left its expected status (--kda-expected)" in done.stdout and "a team's reason" in done.stdout
    expected.write_text("backend,check,device,expected,reason\n")
    assert pytest_run(*argv, "--kda-expected", str(expected), env=ENV).returncode == 0
    expected.write_text("backend,check\n")
    bad = pytest_run(*argv, "--kda-expected", str(expected), env=ENV)
    assert bad.returncode == pytest.ExitCode.USAGE_ERROR and "--kda-expected" in bad.stdout + bad.stderr
