"""What a night reached on each backend: for every required axis value (cases/coverage.py's NIGHT_REQUIRED),
how many distinct cases the backend ran with it, and whether a value it did not reach is one it does not
support (every case with the value skipped as outside its envelope) or one the night missed (flagged)."""

from __future__ import annotations

import pandas as pd

from kda_cases.case import Case
from kda_cases.coverage import NIGHT_REQUIRED, axis_values

SKIPPED = ("skip",)
MISSED = "NOT REACHED"


def backend_coverage(records: pd.DataFrame, required: dict[str, tuple[str, ...]] = NIGHT_REQUIRED) -> pd.DataFrame:
    """One row per backend, required axis and value: ``cases`` run (any verdict but skip), ``skipped``
    cases, and ``status``: reached, not supported (only skips), or NOT REACHED (no case of that value)."""
    columns = ["backend", "axis", "value", "cases", "skipped", "status"]
    if records.empty or "case_json" not in records:
        return pd.DataFrame(columns=columns)
    values_of: dict[str, dict[str, tuple[str, ...]]] = {}
    ran: dict[tuple[str, str, str], set[str]] = {}
    skipped: dict[tuple[str, str, str], set[str]] = {}
    real = records[records["backend"] != "(suite)"]
    for (backend, case_json), group in real.groupby(["backend", "case_json"], sort=False):
        case_id = group["case_id"].iloc[0]
        if case_id not in values_of:
            values_of[case_id] = axis_values(Case.from_json(case_json))
        target = skipped if set(group["verdict"]) <= set(SKIPPED) else ran
        for axis, values in values_of[case_id].items():
            for value in values:
                target.setdefault((backend, axis, value), set()).add(case_id)
    rows = []
    for backend in sorted(real["backend"].unique()):
        for axis, values in required.items():
            for value in values:
                key = (backend, axis, value)
                n_ran, n_skipped = len(ran.get(key, ())), len(skipped.get(key, ()))
                status = "reached" if n_ran else ("not supported" if n_skipped else MISSED)
                rows.append(dict(zip(columns, (backend, axis, value, n_ran, n_skipped, status), strict=True)))
    return pd.DataFrame(rows, columns=columns)


def missed_lines(table: pd.DataFrame) -> list[str]:
    """One line per backend: every required value reached, or the ones it supports and the night missed."""
    lines = []
    for backend, part in table.groupby("backend", sort=True):
        missed = part[part["status"] == MISSED]
        unsupported = (part["status"] == "not supported").sum()
        note = f" ({unsupported} outside its envelope)" if unsupported else ""
        if missed.empty:
            lines.append(f"{backend}: every required value reached{note}")
        else:
            listed = ", ".join(f"{a} {v}" for a, v in zip(missed["axis"], missed["value"], strict=True))
            lines.append(f"{backend}: {len(missed)} required values NOT REACHED: {listed}{note}")
    return lines
