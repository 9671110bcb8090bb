"""Files every layer writes the same way: whole or not at all, and never a temp file left behind.

A run file, a corpus entry or the dashboard is written to a temporary name beside its target, flushed to
disk and renamed onto it, so a reader sees the old file or the whole new one; when anything goes wrong
(a full disk, an interrupt) the temporary file is removed before the error goes on. A folder a run will
write into is tried before the run starts (:func:`unwritable`), so a full or read-only store is one line
at the start, not a traceback after minutes of work.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

# What a run needs free before it starts: its records, summaries and a dashboard of a few MB.
MIN_FREE_BYTES = 64 * 2**20


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` then rename onto ``path``: readers see the old file or the whole new one. The
    temporary file is synced before the rename and removed on any error (ENOSPC, an interrupt)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")  # concurrent writers
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


def unwritable(folder: Path, min_free: int | None = None) -> str | None:
    """Why a run cannot write into ``folder`` (made when missing), or None when it can: the folder cannot
    be made or written, or its disk has less than ``min_free`` bytes free (default MIN_FREE_BYTES)."""
    folder = Path(folder)
    min_free = MIN_FREE_BYTES if min_free is None else min_free
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".kda-write-probe-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            atomic_write(probe, lambda p: p.write_bytes(b"kda-conformance write probe\n"))
        finally:
            probe.unlink(missing_ok=True)
        free = shutil.disk_usage(folder).free
    except OSError as exc:
        what = "the disk is full" if exc.errno == errno.ENOSPC else (exc.strerror or type(exc).__name__)
        return f"{folder} cannot be written: {what}"
    if free < min_free:
        return f"{folder} has {free / 2**20:.1f} MiB free; a run needs at least {min_free / 2**20:.0f} MiB"
    return None
