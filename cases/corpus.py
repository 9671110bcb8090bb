"""The committed corpus: pinned cases (one JSON file each under ``cases/corpus/``) that every profile runs.

Each file holds the case and why it is there. ``kda-conformance corpus add``
pins a case given as JSON, or every failing case of a run file, so a failure a
sweep found keeps being checked after the sweep moves on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from kda_cases.case import Case
from kda_cases.files import atomic_write_text

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"


@dataclass(frozen=True)
class CorpusEntry:
    case: Case
    why: str
    path: Path


def load_corpus(directory: Path = CORPUS_DIR) -> list[CorpusEntry]:
    """Every pinned case, sorted by file name; a file that does not parse is an error that names it."""
    entries = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            data = json.loads(path.read_text())
            entries.append(CorpusEntry(Case.from_dict(data["case"]), str(data.get("why", "")), path))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"corpus file {path.name} is not a valid entry: {exc}") from exc
    return entries


def save_case(case: Case, why: str, directory: Path = CORPUS_DIR) -> tuple[Path, bool]:
    """Pin ``case`` as ``<id>.json``; returns the path and whether it was new (an existing entry is kept)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{case.id}.json"
    if path.exists():
        return path, False
    entry = {
        "id": case.id,
        "why": why,
        "added": datetime.now(UTC).date().isoformat(),
        "case": {**case.to_dict(), "id": case.id},
    }
    atomic_write_text(path, json.dumps(entry, indent=2, sort_keys=True) + "\n")
    return path, True
