"""The sentinels: a fixed set of cases (``cases/sentinels.json``, pinned like the corpus) that the GPU
profiles run every night with the same inputs, so that each sentinel's error has a history of its own.

Each night draws new cases, so a kernel whose error grew 1.4 times, still within its budget (the rule's
rel-RMS factor is 2), hides among them; on a sentinel the same inputs give the same error night after
night, and growth past ``SENTINEL_GROWTH`` times its own median is flagged (reports/regressions.py).

The set spans the dtypes, lengths up to 128K, gate and key regimes and checkpoints at K = V = 128 and 4
query / 8 value heads, with initial states (bf16 and fp16), packing with a zero-length member, 8 query
heads and the V-first layout in bf16, at most 2^34 of work: 8 kernel configurations, all but one of them
the guaranteed cases' or the corpus's (docs/sweeps.md says which sentinels were re-pinned for that).
"""

from __future__ import annotations

import json
from pathlib import Path

from kda_cases.case import Case

SENTINELS_FILE = Path(__file__).resolve().parent / "sentinels.json"
SENTINEL_GROWTH = 1.3  # a sentinel's error/limit past this times its median over the recent nights is flagged


def load_sentinels(path: Path = SENTINELS_FILE) -> list[Case]:
    """The pinned sentinels; an entry whose fields do not give its id is an error that names it."""
    cases = []
    for number, entry in enumerate(json.loads(Path(path).read_text()), 1):
        try:
            cases.append(Case.from_dict(entry))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{Path(path).name}: sentinel {number} is not valid: {exc}") from exc
    return cases


def sentinel_ids(path: Path = SENTINELS_FILE) -> frozenset[str]:
    return frozenset(case.id for case in load_sentinels(path))
