"""Fixtures the suite's tests of itself share."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

# The tests' shared helpers (tests/support/suite_paths.py), importable by name from every test module.
sys.path.insert(0, str(Path(__file__).with_name("support")))
from suite_paths import import_plugin

if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    # A worker per core keeps every core busy: torch's own threads in each worker (and, through OMP_NUM_THREADS,
    # in the detection and nightly subprocesses the tests start) would only contend for the same cores.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def planted_zoo() -> dict[str, tuple[str, str]]:
    """The planted-bug backends of tests/plugins/kda_planted_bugs.py, registered: name -> (what it models,
    where the bug was seen)."""
    return import_plugin("kda_planted_bugs").ZOO


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` for the suite's own tests: a worker per core and one more. Many of these tests wait on a
    subprocess's timeout or a hung double, not on a core: on 2 cores the test command took 785 s with two
    workers and 722 and 723 s with three, 3 % of the CPU idle then (the results journal, nineteenth session)."""
    return len(os.sched_getaffinity(0)) + 1


# The slowest modules first: their detection runs (a few minutes each in one process) then overlap the rest
# of the suite on the other pytest-xdist workers instead of running alone at the end.
FIRST = ("test_planted_bugs.py", "test_correct_variants.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in FIRST)  # stable: every other test keeps its order


def _as_after_a_terminal_fork() -> None:
    # A shell without job control starts a background command with SIGINT ignored, and an ignored signal
    # stays ignored across exec: the suite started that way (`.ci/run &`) would hand its children a Ctrl-C
    # they cannot hear. A terminal's child hears it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.fixture
def interruptible() -> dict[str, Any]:
    """Popen arguments for a child that a test interrupts as a terminal's Ctrl-C would: its own process
    group (os.killpg reaches its workers too) hearing SIGINT however this pytest was started."""
    return {"start_new_session": True, "preexec_fn": _as_after_a_terminal_fork}


@pytest.fixture(autouse=True)
def leaves_torch_as_it_found_it() -> Any:
    """Each test leaves torch's default dtype and grad mode as it found them: a test that left float64
    behind made a later one's pool float64 and failed it far from the cause."""
    import torch

    before = torch.get_default_dtype(), torch.is_grad_enabled()
    yield
    after = torch.get_default_dtype(), torch.is_grad_enabled()
    assert after == before, f"the test changed torch's default dtype or grad mode: {before} -> {after}"
