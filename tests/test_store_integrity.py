"""The store cannot be poisoned: every single-field type mutation of a valid row, a journal line cut at every
byte, bytes that are not UTF-8, markup in every text field. The dashboard builds, names what it skipped and
loses no valid row; writes are whole or absent; a run id is never written twice; regressions compare whole
nights."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from kda_cases import files
from kda_conformance.cli import main
from kda_conformance.cli.exits import FAILED, USAGE
from kda_reports.dashboard import build_dashboard
from kda_reports.runfile import RunRecorder, merge_parts, read_journal
from kda_reports.schema import RECORD_COLUMNS, column_kind
from kda_reports.store import load_store

CASE = '{"seq_lens": [9], "num_heads": 1, "num_v_heads": 1, "head_k_dim": 16, "head_v_dim": 16}'
# A value of another kind for each kind of column (text, a number, a flag, a single value).
WRONG = {
    "text": [7, 1.5, True, [1], {"a": 1}],
    "number": ["abc", True, [1], {"a": 1}],
    "flag": ["abc", 3, [1]],
    "scalar": [[1], {"a": 1}],
}
MARKUP = "[/]<script>alert(1)</script>[red]&amp;"


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The records of one real run, as its journal holds them."""
    out = tmp_path_factory.mktemp("one")
    assert main(["run", "--device", "cpu", "--backend", "torch_chunk", "--case", CASE, "--out", str(out)]) == 0
    frame = pd.read_parquet(next((out / "runs").glob("*.parquet")))
    return json.loads(frame.to_json(orient="records"))


def _journal(path: Path, lines: list[str | bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))


@pytest.mark.slow
def test_every_single_field_type_mutation_is_skipped_and_named_and_no_valid_row_is_lost(
    rows: list[dict], tmp_path: Path
) -> None:
    runs, mutants = tmp_path / "runs", 0
    columns = [c for c in rows[0] if column_kind(c) is not None]
    assert len(columns) > 60
    for column in columns:
        for value in WRONG[column_kind(column)]:
            mutants += 1
            bad = {**rows[0], column: value}
            name = f"20261201T0000{mutants:04d}Z-m.partial.jsonl"
            _journal(runs / name, [json.dumps(r) for r in rows] + [json.dumps(bad)])
    store = load_store(tmp_path)
    named = [p for p in store.problems if "row(s) skipped" in p]
    assert len(named) == mutants, set(columns) - {p.split("skipped: ")[1].split(" ")[0] for p in named}
    assert len(store.records) == mutants * len(rows)  # every valid row of every file kept
    path, _ = build_dashboard(store, tmp_path / "dashboard.html")
    page = path.read_text()
    assert "Files skipped or partly read" in page and page.count("row(s) skipped") == mutants


def test_a_journal_cut_at_every_byte_keeps_its_whole_lines(rows: list[dict], tmp_path: Path) -> None:
    whole, last = json.dumps(rows[0]), json.dumps(rows[1]).encode()
    path = tmp_path / "cut.partial.jsonl"
    for cut in range(len(last)):
        path.write_bytes(whole.encode() + b"\n" + last[:cut])
        problems: list[str] = []
        assert read_journal(path, problems) == [rows[0]], cut
        assert bool(problems) == (cut > 0), cut


def test_bytes_that_are_not_utf8_drop_their_line_only(rows: list[dict], tmp_path: Path) -> None:
    path = tmp_path / "runs" / "20261201T000000Z-bytes.partial.jsonl"
    broken = json.dumps(rows[1]).encode()[:40] + b"\xff\xfe" + json.dumps(rows[1]).encode()[40:]
    _journal(path, [json.dumps(rows[0]), broken, json.dumps(rows[0])])
    store = load_store(tmp_path)
    assert len(store.records) == 2 and any("1 line(s) skipped: not UTF-8" in p for p in store.problems)


def test_an_escaped_lone_surrogate_keeps_its_journal_and_merges(rows: list[dict], tmp_path: Path) -> None:
    # JSON's "\udcff" decodes to a lone surrogate, which no parquet writer takes: before, one such row lost
    # every row of its journal when the parts were merged.
    runs = tmp_path / "runs"
    odd = json.dumps({**rows[0], "reason": "no such file: kernel-\udcff.bin"})
    _journal(runs / "night.gw0.partial.jsonl", [json.dumps(r) for r in rows] + [odd])
    frame, _ = merge_parts(tmp_path, "night", "night.gw", {"run_id": "night", "complete": False}, None)
    assert len(frame) == len(rows) + 1
    assert "no such file: kernel-\\udcff.bin" in set(frame["reason"])


def test_a_damaged_quarantine_file_loses_its_bad_lines_only(rows: list[dict], tmp_path: Path) -> None:
    # A byte that is not UTF-8, or a field that is a list, crashed the dashboard (exit 1) and made every
    # later passing run into the store exit 3.
    from kda_reports.quarantine import read_quarantine

    entry = {"backend": "b", "config": "c", "case_id": "kda-1", "check": "budget", "message": "illegal address"}
    path = tmp_path / "runs" / "20261201T000000Z-q.quarantine.jsonl"
    _journal(path, [json.dumps(entry).encode()[:20] + b"\xff" + json.dumps(entry).encode()[20:],
                    json.dumps({**entry, "backend": ["b"]}), json.dumps(entry)])  # fmt: skip
    assert [q.backend for q in read_quarantine(path)] == ["b"]
    assert main(["dashboard", "--store", str(tmp_path)]) == 0
    assert main(["run", "--device", "cpu", "--backend", "torch_chunk", "--case", CASE, "--out", str(tmp_path)]) == 0


def test_a_torn_worker_journal_merges_up_to_its_last_whole_line(rows: list[dict], tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    _journal(runs / "night.gw0.partial.jsonl", [json.dumps(r) for r in rows])
    (runs / "night.gw1.partial.jsonl").write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1])[:33])
    frame, _ = merge_parts(tmp_path, "night", "night.gw", {"run_id": "night", "complete": False}, None)
    assert len(frame) == len(rows) + 1


def test_markup_in_every_text_field_is_printed_and_shown_as_text(
    rows: list[dict], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    texts = [c for c in rows[0] if column_kind(c) == "text" and c not in ("case_json", "case_seq_lens", "verdict")]
    texts = [c for c in texts if c != "case_checkpoints"]
    marked = [{**row, **dict.fromkeys(texts, MARKUP), "verdict": "fail"} for row in rows]
    _journal(tmp_path / "runs" / "20261201T000000Z-markup.partial.jsonl", [json.dumps(r) for r in marked])
    assert main(["dashboard", "--store", str(tmp_path)]) == 0
    page = (tmp_path / "dashboard.html").read_text()
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    # A failure's message carries the case's JSON (its tags with it) and the reason: printed as they are.
    monkeypatch.syspath_prepend(str(Path(__file__).with_name("plugins")))
    case = json.loads(CASE) | {"tags": [MARKUP]}
    argv = ["run", "--device", "cpu", "--plugin", "kda_hostile", "--backend", "hostile_writes_q"]
    assert main([*argv, "--case", json.dumps(case), "--out", str(tmp_path / "tagged")]) == FAILED
    assert MARKUP in capsys.readouterr().out


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "dashboard.html"

    def disk_full(path: Path) -> None:
        path.write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        files.atomic_write(target, disk_full)
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_or_full_out_is_one_line_before_the_first_case(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    argv = ["run", "--device", "cpu", "--backend", "torch_chunk", "--case", CASE]
    assert main([*argv, "--out", str(blocked)]) == USAGE
    assert "error: --out: " in capsys.readouterr().out and not (tmp_path / "runs").exists()
    monkeypatch.setattr(files, "MIN_FREE_BYTES", 2**62)
    assert main([*argv, "--out", str(tmp_path / "full")]) == USAGE
    out = capsys.readouterr().out
    assert "MiB free; a run needs at least" in out and "Traceback" not in out


def test_a_run_id_that_exists_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--device", "cpu", "--backend", "torch_chunk", "--case", CASE, "--out", str(tmp_path)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KDA_RUN_ID", "x")
        assert main(argv) == 0
        before = sorted(p.name for p in (tmp_path / "runs").iterdir())
        assert main(argv) == USAGE
    assert "a run with id x is already in" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == before


def test_a_run_id_being_written_by_another_process_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two runs given one KDA_RUN_ID at once both saw no file of it, both exited 0, the second's parquet
    # replacing the first's. The other process here holds the id's claim as a run in progress does.
    holder = "import sys, time; from kda_reports.runfile import claim_run; from pathlib import Path"
    holder += "; print(claim_run(Path(sys.argv[1]), 'x'), flush=True); time.sleep(120)"
    (tmp_path / "runs").mkdir()
    other = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    argv = ["run", "--device", "cpu", "--backend", "torch_chunk", "--case", CASE, "--out", str(tmp_path)]
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "None"
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("KDA_RUN_ID", "x")
            assert main(argv) == USAGE
            said = capsys.readouterr().out
            assert "a run with id x is being written to" in said and f"pid {other.pid}" in said, said
            assert not list((tmp_path / "runs").glob("x.*"))
            other.kill()
            other.wait(30)
            assert main(argv) == 0  # the claim went with its process: nothing stale is left
    finally:
        other.kill()


def _night(rows: list[dict], run_id: str, date: str, verdict: str) -> list[dict]:
    env = {"env_run_id": run_id, "env_date": date, "env_complete": True, "run_id": run_id}
    return [{**row, **env, "verdict": verdict} for row in rows]


def test_regressions_compare_the_last_complete_night_and_show_the_unfinished(rows: list[dict], tmp_path: Path) -> None:
    """A run in progress or killed that is the newest in the store hid a new failure of the last complete
    night (1 flag -> 0): the flags compare complete nights only; the newer run is shown, labelled."""
    runs = tmp_path / "runs"
    runs.mkdir()
    for i, (name, verdict) in enumerate([("a", "pass"), ("b", "pass"), ("c", "fail")]):
        run_id = f"2026112{i}T000000Z-{name}"
        pd.DataFrame(_night(rows, run_id, f"2026-11-2{i}T00:00:00", verdict)).to_parquet(runs / f"{run_id}.parquet")
    live = RunRecorder({"date": "2026-11-29T00:00:00"}, tmp_path, "20261129T000000Z-live")
    live.add(rows)  # a night still running: its journal is locked
    store = load_store(tmp_path)
    assert list(store.runs["status"]) == ["complete", "complete", "complete", "in progress"]
    path, flags = build_dashboard(store, tmp_path / "dashboard.html")
    assert set(flags["kind"]) == {"new failure"}
    page = path.read_text()
    assert "Red: last complete run 20261122T000000Z-c" in page and "20261129T000000Z-live (in progress" in page
    assert main(["dashboard", "--store", str(tmp_path), "--fail-on-flags"]) == 1
    live.finish(complete=False)  # interrupted: still not compared
    assert set(build_dashboard(load_store(tmp_path), tmp_path / "d.html")[1]["kind"]) == {"new failure"}


def test_every_documented_column_has_a_kind() -> None:
    assert all(column_kind(c) is not None for c in RECORD_COLUMNS)
