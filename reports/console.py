"""Records as fixed-width lines: what ``-v`` prints as each record is measured, and every run's table (the
CLI's and pytest's alike). Full numbers at any width: a CI log or ``| tee`` gets the same lines a
terminal does, never a table squeezed to 80 columns."""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

# (title, width) of each column; the numbers are those of the run's summary.md.
COLUMNS = (
    ("case", 17),
    ("label", 48),
    ("backend", 26),
    ("check", 13),
    ("tensor", 17),
    ("verdict", 8),
    ("max_abs", 9),
    ("limit", 9),
    ("ratio", 7),
    ("rel_rms", 9),
    ("rms_limit", 9),
    ("rms_ratio", 9),
    ("s", 7),
)
TEXT_COLUMNS = 6
RECORD_LINE_HEADER = " ".join(
    f"{title:{width}}" if i < TEXT_COLUMNS else f"{title:>{width}}" for i, (title, width) in enumerate(COLUMNS)
)


def record_line(r: dict) -> str:
    """One record on one line, under RECORD_LINE_HEADER."""

    def num(key: str, width: int, spec: str = ".2e") -> str:
        value = r.get(key)
        return f"{value:{width}{spec}}" if isinstance(value, float) and value == value else f"{'':{width}}"

    seconds = r.get("seconds")
    return (
        f"{r['case_id']:17} {str(r['label'])[:48]:48} {r['backend']:26} {r.get('check') or 'budget':13} "
        f"{r.get('tensor') or '-':17} "
        f"{r['verdict']:8} {num('max_abs', 9)} {num('budget', 9)} {num('ratio', 7, '.3f')} {num('rel_rms', 9)} "
        f"{num('budget_rel_rms', 9)} {num('rel_rms_ratio', 9, '.3f')} "
        + (f"{seconds:7.2f}" if isinstance(seconds, float) and seconds == seconds else f"{'':7}")
    )


def stale_lines(stale: pd.DataFrame, strict: bool) -> list[str]:
    """One warning per ledger entry that no longer reproduces (findings.stale_known_issues)."""
    what = "a failure under --kda-strict" if not strict else "a failure of this run (--kda-strict)"
    return [
        f"warn: known issue {row.known_issue} no longer reproduces: all {row.cases} cases it matched passed on "
        f"{row.backends}; remove it from conformance/known_issues.toml ({what})"
        for row in stale.itertuples()
    ]


def record_table(rows: Iterable[dict]) -> list[str]:
    """The header and one line per record."""
    return [RECORD_LINE_HEADER, *(record_line(row) for row in rows)]
