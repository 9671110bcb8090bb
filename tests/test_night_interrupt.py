"""An interrupted nightly and its pytest (conformance/cli/nightly.py ``_run_pytest``, running/interrupts.py):
the interrupt reaches pytest once. ``timeout`` and a terminal's Ctrl-C signal the whole process group, and the
nightly used to send its own SIGINT 10 s later whenever pytest had not ended: on an H100 the second one landed
in pytest's merge of its workers' parts and the night's store kept only the parts. A signal sent to the
nightly alone is still passed on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

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
    parent, log = _night(tmp_path, 11.0, interruptible)  # longer than the 10 s the nightly waited
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
