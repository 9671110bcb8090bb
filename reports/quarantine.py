"""The quarantine file of a run part (``runs/<run>[.<part>].quarantine.jsonl``): one line per (backend, kernel
configuration) that left the device context dead once that night. What the lines hold and how they are read
and appended lives here (the dashboard and the store read them); when a case is not launched because of
them is the run's decision (conformance/running/quarantine.py)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from kda_reports.findings import writable


@dataclass(frozen=True)
class Quarantined:
    """The crash a configuration was quarantined after."""

    backend: str
    config: str  # config_label of the kernel configuration
    case_id: str
    check: str
    message: str
    # "error": it crashed the device; "skip": the compile stage's time budget left it uncompiled (no crash)
    verdict: str = "error"

    @property
    def reason(self) -> str:
        if self.verdict == "skip":
            return f"not compiled: {self.message} ({self.config}); not launched"
        return (
            f"quarantined after {self.case_id} ({self.check}) crashed this kernel configuration ({self.config}): "
            f"{self.message}; not launched"
        )


def read_quarantine(path: Path) -> list[Quarantined]:
    """The entries of a quarantine file (none where there is no file); a line cut by a killed writer, one
    that is not UTF-8, or one that is not an entry (a field that is not text) is left out and the others
    still hold."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    entries = []
    for line in raw.splitlines():
        try:
            fields = json.loads(line.decode("utf-8"))
            entry = Quarantined(**fields)
        except (ValueError, TypeError):  # UnicodeDecodeError is a ValueError
            continue
        if all(isinstance(value, str) for value in entry.__dict__.values()):
            entries.append(Quarantined(**{k: writable(v) for k, v in entry.__dict__.items()}))
    return entries


def append_quarantine(path: Path, entry: Quarantined) -> None:
    """Add ``entry`` to the file in one short write in append mode, so that the lines of workers writing at
    once do not interleave."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(entry.__dict__) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
