"""A time limit's SIGTERM (CI's job limit, ``timeout``) stops a run as Ctrl-C does.

Left at its default, SIGTERM ends a process at once: a pytest-xdist worker killed inside a backend's call
leaves the journal's row for that call (running/journal.py), so a night cut by its time limit charged every
call in flight to its kernel as "the process ended during the call". As a KeyboardInterrupt it unwinds
through the executor, which settles the call (nothing of it is recorded), and the records so far are kept.
A process stuck where Python never runs again (a hung kernel) still dies inside its call, as it should.

A night's pytest says it heard an interrupt by touching the file ``STOPPING_VARIABLE`` names: the nightly
that started it passes an interrupt on only where pytest did not hear it (a signal sent to the nightly's
process alone), and never a second one into pytest's merge of its workers' parts (``timeout`` signals the
whole process group: on an H100 the merge took more than 10 s, the nightly sent its own SIGINT, and the
night's store kept only the workers' parts).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

STOPPING_VARIABLE = "KDA_STOPPING_FILE"

# What signal.signal takes and returns: a handler, or SIG_DFL / SIG_IGN, or None (one set outside Python).
Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def _interrupt(signum: int, frame: FrameType | None) -> None:
    guard = sys.modules.get("kda_kernels.guard")  # a backend's call runs only where the guard is loaded
    if guard is not None:
        guard.note_signal()
    raise KeyboardInterrupt


def sigterm_as_interrupt() -> Handler:
    """Make SIGTERM raise KeyboardInterrupt in this process; returns the handler it replaced."""
    return signal.signal(signal.SIGTERM, _interrupt)


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt inside the block; the previous handler is restored after it."""
    previous = sigterm_as_interrupt()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def say_stopping() -> None:
    """Touch the file ``STOPPING_VARIABLE`` names, where it names one: this process heard the interrupt and
    is writing what it measured."""
    path = os.environ.get(STOPPING_VARIABLE)
    if path:
        Path(path).touch()


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (its children, theirs, ...), read from Linux's /proc; none where there is no
    /proc to read."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # a process that ended while it was read
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def interrupt_tree(pid: int) -> None:
    """SIGINT to ``pid`` and every process below it, as a terminal's Ctrl-C reaches a process group: a night's
    pytest and its pytest-xdist workers hear it together, each writing its part of the run."""
    for target in [pid, *descendants(pid)]:
        try:
            os.kill(target, signal.SIGINT)
        except ProcessLookupError:
            pass
