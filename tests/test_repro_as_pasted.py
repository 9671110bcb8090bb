"""Repro lines that run as pasted (issue 52, item 2): a plugin is named by what finds it again from any
directory, and ``--plugin`` takes a file's path and the current directory's modules."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from suite_paths import PLUGINS, REPO

from kda_cases.case import Case
from kda_conformance.cli import main
from kda_conformance.cli.exits import FAILED, PASSED, USAGE
from kda_reports.store import load_store

CASE = Case(seq_lens=(40,)).to_json()
MY_BACKENDS = """
from kda_kernels.api import register
from kda_kernels.torch_chunk import TorchChunk


class Mine(TorchChunk):
    name = "my_copy_of_the_baseline"


register(Mine.name, Mine, replace=True)
"""


def _cli(words: list[str], cwd: Path, pythonpath: str = "") -> subprocess.CompletedProcess:
    """``kda-conformance WORDS`` as a fresh shell runs it: no PYTHONPATH unless given."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    command = [sys.executable, "-m", "kda_conformance.cli", *words]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_plugin_backends_repro_line_reruns_its_failure_from_another_directory(tmp_path: Path) -> None:
    # The printed line's "--plugin kda_planted_bugs" exited 2 there: the plugin's folder was on PYTHONPATH
    # in the run and is not in the line.
    out = tmp_path / "out"
    run = ["run", "--device", "cpu", "--plugin", "kda_planted_bugs", "--backend", "planted_nan_at_one_position"]
    done = _cli([*run, "--case", CASE, "--out", str(out), "--no-dashboard"], REPO, pythonpath=str(PLUGINS))
    assert done.returncode == FAILED, done.stdout[-2000:] + done.stderr[-2000:]
    records = load_store(out).records
    repro = records[records["verdict"] == "fail"]["repro"].iloc[0]
    assert f"--plugin {(PLUGINS / 'kda_planted_bugs.py').resolve()} " in repro
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    again = _cli([*shlex.split(repro)[1:], "--out", str(elsewhere / "out"), "--no-dashboard"], elsewhere)
    assert again.returncode == FAILED, again.stdout[-2000:] + again.stderr[-2000:]


def test_plugin_takes_a_files_path_and_the_current_directorys_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_kda_backends.py").write_text(MY_BACKENDS)
    monkeypatch.chdir(tmp_path)
    run = ["run", "--device", "cpu", "--backend", "my_copy_of_the_baseline", "--case", CASE, "--no-dashboard"]
    # "./my_kda_backends.py" was a relative-import TypeError blamed on the module, "my_kda_backends" from its
    # own folder "No module named" without PYTHONPATH=.
    assert main([*run, "--plugin", "./my_kda_backends.py", "--out", str(tmp_path / "a")]) == PASSED
    assert main([*run, "--plugin", "my_kda_backends", "--out", str(tmp_path / "b")]) == PASSED
    repro = load_store(tmp_path / "a").records["repro"].iloc[0]
    assert f"--plugin {(tmp_path / 'my_kda_backends.py').resolve()} " in repro


def test_a_plugin_path_that_is_not_there_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "--device", "cpu", "--plugin", str(tmp_path / "gone.py"), "--case", CASE]
    assert main([*argv, "--out", str(tmp_path)]) == USAGE
    assert f"plugin {str(tmp_path / 'gone.py')!r}: no such file or folder" in capsys.readouterr().out
