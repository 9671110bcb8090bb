"""An interrupted nightly and its pytest (conformance/cli/nightly.py ``_run_pytest``, running/interrupts.py):
the interrupt reaches pytest once, and under --time-limit the nightly stops its tests itself, in time.
``timeout`` and a terminal's Ctrl-C signal the whole process group, and the nightly used to send its own SIGINT
10 s later whenever pytest had not ended: on an H100 the second one landed in pytest's merge of its workers'
parts and the night's store kept only the parts. A signal sent to the nightly alone is still passed on."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from suite_paths import ENV

from kda_reports.store import load_store

# Stands for the night's pytest: on SIGINT it says it heard it (as the plugin's hook does) and takes longer than
# the nightly's patience to write its files; a second SIGINT in that time is what the fix keeps away.
CHILD = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path
    from kda_conformance.running.interrupts import say_stopping
    log = Path(sys.argv[1])
    def second(signum, frame):
        log.write_text("interrupted while writing")
        sys.exit(99)
    try:
        log.write_text("running")
        time.sleep(60)
    except KeyboardInterrupt:
        say_stopping()
        signal.signal(signal.SIGINT, second)
        time.sleep(float(sys.argv[2]))
        log.write_text("written")
        sys.exit(2)
    """
)

# Stands for the nightly: runs the child through _run_pytest with a 1 s patience.
PARENT = textwrap.dedent(
    """
    import os, sys
    from rich.console import Console
    from kda_conformance.cli import nightly
    nightly.HEARD_WITHIN = 1.0
    code = nightly._run_pytest([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], dict(os.environ), Console())
    print("exit", code)
    """
)


def _night(tmp_path: Path, writing_seconds: float, interruptible: dict[str, Any]) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "child.log"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD, str(log), str(writing_seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **interruptible,
    )
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_text() == "running") and time.monotonic() < deadline:
        time.sleep(0.1)
    return parent, log


def test_an_interrupt_the_whole_group_heard_is_not_sent_again(tmp_path: Path, interruptible: dict) -> None:
    parent, log = _night(tmp_path, 3.0, interruptible)  # longer than the 1 s the nightly waits here
    os.killpg(parent.pid, signal.SIGINT)  # as `timeout` and a terminal's Ctrl-C: the whole process group
    output, _ = parent.communicate(timeout=60)
    assert log.read_text() == "written", output
    assert "exit 130" in output and "Traceback" not in output, output


def test_an_interrupt_sent_to_the_nightly_alone_is_passed_on(tmp_path: Path, interruptible: dict) -> None:
    parent, log = _night(tmp_path, 0.5, interruptible)
    parent.send_signal(signal.SIGINT)  # the nightly's process only: its pytest heard nothing
    output, _ = parent.communicate(timeout=60)
    assert log.read_text() == "written", output
    assert "exit 130" in output, output


def test_pytest_says_it_heard_the_interrupt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kda_conformance import pytest_plugin
    from kda_conformance.running.interrupts import STOPPING_VARIABLE

    monkeypatch.setenv(STOPPING_VARIABLE, str(tmp_path / "stopping"))
    pytest_plugin.pytest_keyboard_interrupt(None)
    assert (tmp_path / "stopping").exists()
    monkeypatch.delenv(STOPPING_VARIABLE)
    pytest_plugin.pytest_keyboard_interrupt(None)  # outside a nightly: nothing to touch, nothing raised


# Stands for the night's pytest with a worker: both hear one SIGINT, as a terminal's Ctrl-C reaches them.
WITH_A_WORKER = textwrap.dedent(
    """
    import subprocess, sys, time
    from pathlib import Path
    log, worker_log = Path(sys.argv[1]), Path(sys.argv[2])
    WORKER = "import sys, time\\nfrom pathlib import Path\\ntry:\\n    time.sleep(60)\\nexcept KeyboardInterrupt:\\n"
    WORKER += "    Path(sys.argv[1]).write_text('worker heard it')\\n"
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(worker_log)])
    try:
        log.write_text("running")
        time.sleep(60)
    except KeyboardInterrupt:
        worker.wait(timeout=30)
        log.write_text("written")
        sys.exit(2)
    """
)

# Stands for the nightly under --time-limit: its tests' deadline 3 s away.
DEADLINE = textwrap.dedent(
    """
    import os, sys, time
    from rich.console import Console
    from kda_conformance.cli import nightly
    command = [sys.executable, "-c", sys.argv[1], *sys.argv[2:]]
    code = nightly._run_pytest(command, dict(os.environ), Console(), deadline=time.monotonic() + 3)
    print("exit", code)
    """
)


def test_at_its_deadline_the_tests_and_their_workers_are_stopped_once_and_written(tmp_path: Path) -> None:
    log, worker_log = tmp_path / "child.log", tmp_path / "worker.log"
    done = subprocess.run(
        [sys.executable, "-c", DEADLINE, WITH_A_WORKER, str(log), str(worker_log)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert log.read_text() == "written" and worker_log.read_text() == "worker heard it", done.stdout + done.stderr
    assert "exit 2" in done.stdout and "time limit: the tests are stopped" in done.stdout, done.stdout


def test_a_time_limit_bounds_the_compile_stage_and_a_smaller_budget_stands() -> None:
    from kda_conformance.cli.nightly import COMPILE_SHARE, compile_budget

    def budget(limit: float | None, given: float | None) -> float | None:
        return compile_budget(argparse.Namespace(time_limit=limit, compile_budget=given))

    assert budget(None, None) is None and budget(None, 200.0) == 200.0
    assert budget(600.0, None) == COMPILE_SHARE * 600.0 and budget(600.0, 100.0) == 100.0


@pytest.mark.slow
def test_a_nightly_past_its_time_limit_ends_in_time_with_what_ran(tmp_path: Path) -> None:
    """A backend that hangs keeps the night from ending; with --time-limit 60 the nightly stops its tests at 30 s
    (the last 30 s kept for writing), writes the run, its night file and the dashboard, and exits 2."""
    command = [sys.executable, "-m", "kda_conformance.cli", "nightly", "--store", str(tmp_path), "--device", "cpu"]
    command += ["--profile", "smoke", "--examples", "1", "--workers", "2", "--plugin", "kda_planted_crashes"]
    command += ["--backend", "torch_chunk", "--backend", "planted_hang", "--time-limit", "60"]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300, check=False)
    assert done.returncode == 2 and time.monotonic() - started < 60, done.stdout[-3000:]
    assert "Traceback" not in done.stdout + done.stderr, done.stdout[-3000:]
    [night_file] = (tmp_path / "runs").glob("*.night.json")
    night = json.loads(night_file.read_text())
    assert night["time_limit"] == 60 and night["stopped_at_time_limit"] is True
    records = load_store(tmp_path).records
    assert (records[records["backend"] == "torch_chunk"]["verdict"] == "pass").any()
    assert (tmp_path / "dashboard.html").stat().st_size > 20_000
