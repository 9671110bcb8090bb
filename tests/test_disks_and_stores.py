"""Disks and stores the suite does not control (issue 51): a write that fails says so in one line naming the
path and exits 2, keeping what was written before; a store's ``runs`` that is not a folder is an error; only
regular files are read from a store (a FIFO named like a journal made the dashboard wait forever)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kda_cases import files
from kda_conformance.cli import main
from kda_reports.runfile import read_journal

RUN = ["run", "--device", "cpu", "--backend", "torch_chunk", "--lengths", "20,37", "--dtypes", "bf16"]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    assert main([*RUN, "--out", str(tmp_path / "store"), "--no-dashboard"]) == 0
    return tmp_path / "store"


def _refuse(monkeypatch: pytest.MonkeyPatch, code: int, under: Path) -> None:
    """Every finished file under ``under`` fails to land as a full or read-only disk fails it (os.replace, the
    last step of each atomic write; CI runs as root, where a folder's mode stops no write)."""
    replace = os.replace

    def refused(src: object, dst: object, *args: object, **kwargs: object) -> None:
        if str(dst).startswith(str(under)) and ".kda-write-probe" not in str(dst):  # the space probe passes
            raise OSError(code, os.strerror(code), str(dst))
        replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(files.os, "replace", refused)


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC], ids=["read-only", "disk-full"])
@pytest.mark.parametrize("command", ["dashboard", "findings", "run --junit-xml"])
def test_a_write_that_fails_is_one_line_and_exit_2(
    command: str, code: int, store: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _refuse(monkeypatch, code, store)
    argv = {
        "dashboard": ["dashboard", "--store", str(store)],
        "findings": ["findings", "--store", str(store)],
        "run --junit-xml": [*RUN, "--out", str(store), "--no-dashboard", "--junit-xml", str(store / "j.xml")],
    }[command]
    assert main(argv) == 2
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and os.strerror(code) in said[0] and str(store) in said[0], out
    assert "Traceback" not in out


def test_a_run_on_a_full_disk_keeps_its_records_in_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _refuse(monkeypatch, errno.ENOSPC, tmp_path)  # the journal is appended to line by line; the finished files fail
    assert main([*RUN, "--out", str(tmp_path), "--no-dashboard"]) == 2
    [journal] = (tmp_path / "runs").glob("*.partial.jsonl")
    problems: list[str] = []
    assert len(read_journal(journal, problems)) >= 2 and not problems
    assert "No space left on device" in capsys.readouterr().out


def test_a_runs_that_is_a_file_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "runs").write_text("not a folder")
    assert main(["dashboard", "--store", str(tmp_path)]) == 2
    assert "runs' is not a folder" in capsys.readouterr().out


def test_a_fifo_named_like_a_run_file_is_skipped_not_waited_on(store: Path) -> None:
    for name in ("fifo-run.partial.jsonl", "fifo-run.night.json", "fifo-run.quarantine.jsonl"):
        os.mkfifo(store / "runs" / name)
    command = "import sys; from kda_conformance.cli import main; sys.exit(main(sys.argv[1:]))"
    try:
        done = subprocess.run(
            [sys.executable, "-c", command, "dashboard", "--store", str(store)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the dashboard waited on a FIFO")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fifo-run.partial.jsonl: not a regular file; skipped" in done.stdout
