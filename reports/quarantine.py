"""Quarantine after a crash: a (backend, kernel configuration) that left the device context dead once is not
launched again in the same night.

A sticky device error ends its worker; pytest-xdist starts another (a new CUDA context, imports, kernels
loaded again), and the next case of the same configuration would crash that one too: on the H200, FLA's
32-token chunk path crashed 12 workers on fp32 cases in two thirds of a night. The first crash keeps its
full record and repro; later cases of its configuration on that backend are recorded as errors that name it,
without launching. The list is a file of the run part (``runs/<run>[.<part>].quarantine.jsonl``) that every
worker of the host appends to and reads, so it holds for one night and one host only, and never touches
another configuration or backend.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from kda_cases.case import Case
from kda_cases.kernel_configs import config_label, kernel_config


@dataclass(frozen=True)
class Quarantined:
    """The crash a configuration was quarantined after."""

    backend: str
    config: str  # config_label of the kernel configuration
    case_id: str
    check: str
    message: str

    @property
    def reason(self) -> str:
        return (
            f"quarantined after {self.case_id} ({self.check}) crashed this kernel configuration ({self.config}): "
            f"{self.message}; not launched"
        )


class Quarantine:
    """The run part's quarantine list, kept in ``path`` (re-read when another worker has appended to it)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._entries: dict[tuple[str, str], Quarantined] = {}
        self._seen_size = -1

    def add(self, backend: str, case: Case, check: str, message: str) -> Quarantined:
        """Quarantine ``case``'s configuration on ``backend`` after its crash (kept if already there)."""
        entry = Quarantined(backend, config_label(kernel_config(case)), case.id, check, message.splitlines()[0][:300])
        if self.find(backend, case) is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            line = json.dumps(entry.__dict__) + "\n"
            # One short write in append mode: lines of workers writing at once do not interleave.
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            self._entries.setdefault((backend, entry.config), entry)
        return entry

    def find(self, backend: str, case: Case) -> Quarantined | None:
        """The crash that quarantined ``case``'s configuration on ``backend``, or None."""
        self._reload()
        return self._entries.get((backend, config_label(kernel_config(case))))

    def entries(self) -> list[Quarantined]:
        self._reload()
        return list(self._entries.values())

    def _reload(self) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size == self._seen_size:
            return
        self._seen_size = size
        for line in self.path.read_text().splitlines():
            try:
                entry = Quarantined(**json.loads(line))
            except (ValueError, TypeError):  # a line cut by a killed writer: the others still hold
                continue
            self._entries.setdefault((entry.backend, entry.config), entry)


def load_quarantines(runs: Path, run_id: str) -> list[Quarantined]:
    """Every quarantine of run ``run_id`` (all its parts) under the store's ``runs`` folder."""
    found: list[Quarantined] = []
    for path in sorted(Path(runs).glob(f"{run_id}*.quarantine.jsonl")):
        found += Quarantine(path).entries()
    return found
