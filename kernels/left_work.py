"""Work a backend's call leaves running when it returns: Python threads and child processes.

A call ends when it returns. Before this module, a thread a backend started that wrote into its input ``q``
0.05 s after the call returned was charged to whichever backend ran next; one that changed torch's default
dtype or the suite's truths later, likewise; a non-daemon thread that never ended kept ``run``, ``repro``
and ``pytest`` from exiting; a child holding the run's standard output kept a reader's pipe open after the
run had ended. So the guard (kernels/guard.py) takes :func:`running` before each call and, when the call
returns, waits up to :data:`GRACE` seconds for what it started to end (:func:`started_since`): whatever
ends within it is part of the call, its effects checked with the call's. What is still running after
that is the backend's failure and is remembered as its own (:func:`leave`):

- the copies of what its calls were handed are kept while the thread lives (kernels/guard.py), and a late
  write into those tensors is put back and charged to it, wherever it lands: during another backend's call
  on the same tensors too, which is not charged for it;
- while such a thread lives, the guard proves the world before each later call and charges what changed
  to the backend that left the thread (:func:`owners`);
- the front ends exit without joining such threads, after writing everything (exit_past_left_work),
  and the children left running are killed, with their own children, when the process ends
  (:func:`end_children`).

Threads are Python's (``threading``); a library's native threads (CUDA's, OpenMP's) are not seen, and
Python's own helper processes (multiprocessing's resource tracker and fork server) are not a backend's.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

# Seconds a call's threads and children get to end after it returns before they are its failure.
GRACE = 1.0


@dataclass(frozen=True)
class Running:
    """Python threads and child processes alive at one moment."""

    threads: frozenset[threading.Thread] = frozenset()
    children: frozenset[int] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.threads or self.children)


def _threads() -> frozenset[threading.Thread]:
    # A _DummyThread is a foreign (native) thread that once called into Python: not started here, never joined.
    return frozenset(t for t in threading.enumerate() if not isinstance(t, threading._DummyThread) and t.is_alive())


def _state(pid: int) -> str:
    """A process's state letter (R, S, Z, ...), "" where it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _alive(pid: int) -> bool:
    return _state(pid) not in ("", "Z", "X")  # a zombie has ended: only its exit status waits to be read


def children_of(pid: int) -> set[int]:
    """The live child processes of ``pid`` (Linux's /proc; elsewhere none are seen)."""
    found: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/{pid}/task/{task}/children") as listed:
                found.update(int(child) for child in listed.read().split())
    return {child for child in found if _alive(child)}


def _python_helpers() -> set[int]:
    """multiprocessing's own helper processes (started by its first Queue or shared memory, kept for the
    process's life): Python's, not the backend that happened to use it first."""
    helpers = set()
    with contextlib.suppress(Exception):
        from multiprocessing import forkserver, resource_tracker

        for helper in (resource_tracker._resource_tracker, forkserver._forkserver):
            pid = getattr(helper, "_pid", None) or getattr(helper, "_forkserver_pid", None)
            if pid:
                helpers.add(pid)
    return helpers


def running() -> Running:
    return Running(_threads(), frozenset(children_of(os.getpid())))


def started_since(before: Running, grace: float | None = None) -> Running:
    """What was started since ``before`` and is still running after up to ``grace`` seconds (default
    :data:`GRACE`) of waiting for it to end."""
    deadline = time.monotonic() + (GRACE if grace is None else grace)
    while True:
        threads = _threads() - before.threads
        children = frozenset(children_of(os.getpid()) - before.children - _python_helpers())
        left = time.monotonic() - deadline
        if not (threads or children) or left >= 0:
            return Running(threads, children)
        if threads:
            next(iter(threads)).join(timeout=min(-left, 0.05))
        else:
            time.sleep(min(-left, 0.01))


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().split(b"\0", 1)[0].decode(errors="replace").rsplit("/", 1)[-1] or "?"
    except OSError:
        return "?"


def described(left: Running) -> str:
    """``left`` in words, for the breach that charges it."""
    parts = []
    if left.threads:
        names = ", ".join(f"{t.name!r}{' (daemon)' if t.daemon else ''}" for t in sorted(left.threads, key=str))
        parts.append(f"{len(left.threads)} thread{'s' if len(left.threads) > 1 else ''} ({names})")
    if left.children:
        pids = ", ".join(f"{pid} ({_command(pid)})" for pid in sorted(left.children))
        parts.append(f"{len(left.children)} child process{'es' if len(left.children) > 1 else ''} ({pids})")
    said = " and ".join(parts)
    return (
        f"left {said} running {GRACE:g} s after its call returned: its later work is charged to it, its children"
        " are killed when the run ends, and the run does not wait for its threads"
    )


# What calls left running, with the backend each is charged to (its object: a breach needs its name).
_threads_left: dict[threading.Thread, object] = {}
_children_left: dict[int, object] = {}


def leave(left: Running, backend: object) -> None:
    """Remember ``left`` as ``backend``'s."""
    _threads_left.update(dict.fromkeys(left.threads, backend))
    _children_left.update(dict.fromkeys(left.children, backend))


def owners() -> list[object]:
    """The backends whose left threads are alive, or ended but not yet forgotten (:func:`forget`: what they
    did in the meantime is theirs)."""
    found: list[object] = []
    for backend in _threads_left.values():
        if not any(backend is seen for seen in found):
            found.append(backend)
    return found


def ended() -> list[threading.Thread]:
    """The left threads that have ended: all they did is done (taken before proving what they did, so that
    one ending during the proof is proved again next time, not forgotten unproved)."""
    return [thread for thread in _threads_left if not thread.is_alive()]


def forget(threads: list[threading.Thread]) -> None:
    for thread in threads:
        _threads_left.pop(thread, None)


def blocks_exit() -> bool:
    """Whether the interpreter's normal exit would wait on work a backend left (a non-daemon thread it joins
    forever) or leave a child holding the run's pipes."""
    threads = any(t.is_alive() and not t.daemon for t in _threads_left)
    return threads or any(_alive(pid) for pid in _children_left)


def _descendants(pids: Iterable[int]) -> list[int]:
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.append(pid)
        todo.extend(children_of(pid))
    return found


def kill_tree(pid: int, itself: bool = True) -> None:
    """SIGKILL ``pid``'s descendants (and ``pid`` unless ``itself`` is False), the deepest first."""
    tree = _descendants([pid])
    for each in reversed(tree if itself else tree[1:]):
        with contextlib.suppress(OSError):
            os.kill(each, signal.SIGKILL)


def end_children() -> None:
    """Kill the children calls left running, with their own children: none holds the run's pipes open."""
    for pid in list(_children_left):
        if _alive(pid):
            kill_tree(pid)
        del _children_left[pid]


atexit.register(end_children)


# os._exit itself, taken before the guard traps it during a backend's call (kernels/guard.py). The front ends
# end a process through these, and they import no torch: a command that ran no backend starts and ends fast.
real_exit = os._exit


def end_process(code: int) -> None:
    """End this process now, whatever a backend call in another thread is doing (``os._exit`` itself, not
    the guard's trap)."""
    real_exit(code)


def flush_and_exit(code: int) -> None:
    """End this process with ``code`` after flushing its standard streams, whatever a backend registered to
    run at exit or left of ``os._exit`` (a stream it closed is skipped), and the children backends left
    running killed (:func:`end_children`)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    end_children()
    real_exit(code)


def exit_past_left_work(code: int) -> None:
    """Where a backend left a thread the interpreter would join forever, or a child holding the run's pipes:
    end the process now with ``code`` (everything is written by then). Else return, for a normal exit."""
    if blocks_exit():
        flush_and_exit(code)
