"""Quarantine after a crash: a (backend, kernel configuration) that left the device context dead once is not
launched again in the same night.

A sticky device error ends its worker; pytest-xdist starts another (a new CUDA context, imports, kernels
loaded again), and the next case of the same configuration would crash that one too: on the H200, FLA's
32-token chunk path crashed 12 workers on fp32 cases in two thirds of a night. The first crash keeps its
full record and repro; later cases of its configuration on that backend are recorded as errors that name it,
without launching. The list is a file of the run part (reports/quarantine.py) that every worker of the host
appends to and reads, so it holds for one night and one host only, and never touches another configuration
or backend.
"""

from __future__ import annotations

from pathlib import Path

from kda_cases.case import Case
from kda_cases.kernel_configs import config_label, kernel_config
from kda_reports.quarantine import Quarantined, append_quarantine, read_quarantine


class Quarantine:
    """The run part's quarantine list, kept in ``path`` (re-read when another worker has appended to it)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._entries: dict[tuple[str, str], Quarantined] = {}
        self._seen_size = -1

    def add(self, backend: str, case: Case, check: str, message: str, verdict: str = "error") -> Quarantined:
        """Quarantine ``case``'s configuration on ``backend`` after its crash (kept if already there); with
        ``verdict`` "skip", a configuration the compile stage did not reach: its cases are skipped, not run."""
        label, first_line = config_label(kernel_config(case)), message.splitlines()[0][:300]
        entry = Quarantined(backend, label, case.id, check, first_line, verdict)
        if self.find(backend, case) is None:
            append_quarantine(self.path, entry)
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
        for entry in read_quarantine(self.path):
            self._entries.setdefault((entry.backend, entry.config), entry)
