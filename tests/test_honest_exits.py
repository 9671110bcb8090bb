"""Exit codes that cannot lie (issue 51): a backend that registers ``os._exit(0)`` at exit, or a plugin that
ends the process at import, cannot turn a failed or broken run into a green exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from suite_paths import PLUGINS, REPO

ENTRY = "from kda_conformance.cli import entry; entry()"


def _run(args: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(PLUGINS)}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_a_failed_run_exits_1_whatever_a_backend_registered_to_run_at_exit(tmp_path: Path) -> None:
    argv = ["run", "--device", "cpu", "--plugin", "kda_green_exit", "--backend", "green_exit_wrong_output"]
    done = _run([sys.executable, "-c", ENTRY, *argv, "--lengths", "20", "--dtypes", "bf16", "--out", str(tmp_path)])
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "fail" in done.stdout


def test_a_failed_pytest_session_exits_1_whatever_a_backend_registered_to_run_at_exit(tmp_path: Path) -> None:
    args = [sys.executable, "-m", "pytest", "conformance/test_first_sweep.py", "-q", "-p", "no:cacheprovider"]
    args += ["--kda-plugin", "kda_green_exit", "--kda-backend", "green_exit_wrong_output", "--kda-device", "cpu"]
    done = _run([*args, "--kda-out", str(tmp_path), "-k", "37 and bf16"])
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.parametrize("command", [["run", "--device", "cpu"], ["backends"]])
def test_a_plugin_that_ends_the_process_at_import_is_exit_2_naming_it(command: list[str]) -> None:
    done = _run([sys.executable, "-c", ENTRY, *command, "--plugin", "kda_exits_at_import"])
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "plugin module 'kda_exits_at_import' called os._exit(0) at import" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("accept", "code"), [("0", 4), ("1", 0)])
def test_a_pytest_session_whose_case_ran_out_of_memory_is_not_checked(accept: str, code: int, tmp_path: Path) -> None:
    # A kernel never judged passed CI under pytest (its test a skip, the session 0): the session says
    # "not checked" with kda-conformance's exit 4, unless KDA_ACCEPT_RESOURCE=1 counts it as a skip.
    args = [sys.executable, "-m", "pytest", "conformance/test_first_sweep.py", "-q", "-p", "no:cacheprovider"]
    args += ["--kda-plugin", "kda_planted_crashes", "--kda-backend", "planted_oom_always", "--kda-device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(PLUGINS), "KDA_ACCEPT_RESOURCE": accept}
    done = subprocess.run(
        [*args, "--kda-out", str(tmp_path), "-k", "37 and bf16"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == code, done.stdout[-2000:] + done.stderr[-2000:]
    assert ("KDA conformance: not checked" in done.stdout) == (accept == "0")
