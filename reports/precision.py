"""What a declared working precision costs (kernels/protocol.py ``WorkingPrecision``): per backend that
declares one, how its judged records stand against the strict baseline's limits beside the declared ones.

A declaration moves a backend's verdicts to the baseline at its documented precision; the strict ratios the
records keep show the price of the design apart from those verdicts ("bf16 state every 16 tokens: 2.8x the
strict limits at worst"). A declaration under which every record also passes the strict limits hides
nothing: it is reported as unnecessary.
"""

from __future__ import annotations

import math

import pandas as pd

from kda_cases.case import DTYPES

# Verdicts of records past the declared limits: findings, apart from what the design costs.
BEYOND_DESIGN = ("fail", "known", "error")
COLUMNS = ["backend", "precision", "records", "over_strict", "worst_strict", "worst_declared", "by_dtype", "note"]


def precision_costs(records: pd.DataFrame) -> pd.DataFrame:
    """One row per (backend, declared precision): its judged records, how many are past the strict limits,
    the worst ratio against the strict and the declared limits, and a note (the cost, or that the
    declaration is unnecessary)."""
    if records.empty or "precision" not in records or "strict_ratio" not in records:
        return pd.DataFrame(columns=COLUMNS)
    declared = records[records["precision"].astype(object).fillna("").astype(str) != ""]
    rows = []
    for (backend, precision), judged in declared.groupby(["backend", "precision"], sort=True):
        # What the design costs is read where the kernel meets its design: a record past the declared limits
        # (a failure, a known issue, a crash's non-finite output) is a finding, not the design's price.
        beyond = judged["verdict"].isin(BEYOND_DESIGN) if "verdict" in judged else pd.Series(False, judged.index)
        part = judged[~beyond]
        strict = pd.to_numeric(part["strict_ratio"], errors="coerce").dropna()
        if strict.empty:
            if beyond.any():
                note = f"{precision}: all {int(beyond.sum())} records past the declared limits (findings): no cost read"
                rows.append(dict(zip(COLUMNS, (backend, precision, 0, 0, math.nan, math.nan, "", note), strict=True)))
            continue
        ratios = [pd.to_numeric(part[c], errors="coerce") for c in ("ratio", "rel_rms_ratio") if c in part]
        worst_declared = float(pd.concat(ratios).max()) if ratios else float("nan")
        over, worst = int((strict > 1).sum()), float(strict.max())
        if over:
            note = f"{precision}: {worst:.3g}x the strict limits at worst ({over} of {len(strict)} records past them)"
        else:
            note = (
                f"declared {precision}, but all {len(strict)} records pass the strict limits (worst {worst:.3g}x): "
                "the declaration is unnecessary"
            )
            judged_dtypes = set(part["case_dtype"].astype(str)) if "case_dtype" in part else set(DTYPES)
            unjudged = [d for d in DTYPES if d not in judged_dtypes]
            if unjudged:  # on an H100 fla_chunk32's fp32 configurations all crashed: its TF32 went unmeasured
                judged_text = ", ".join(d for d in DTYPES if d in judged_dtypes)
                note += f" on {judged_text} inputs; no {' or '.join(unjudged)} record was judged"
        left_out = int(beyond.sum())
        if left_out:
            note += f"; {left_out} records past the declared limits left out (findings, not the design's cost)"
        values = (backend, precision, len(strict), over, worst, worst_declared, _by_dtype(part), note)
        rows.append(dict(zip(COLUMNS, values, strict=True)))
    return pd.DataFrame(rows, columns=COLUMNS)


def _by_dtype(part: pd.DataFrame) -> str:
    """What a user passing each input dtype gets: the worst strict ratio and the records past the strict limits
    ("fp32 112x (16 of 16 past), bf16 0.5x (0 of 18 past)")."""
    if "case_dtype" not in part:
        return ""
    shown = []
    for dtype, rows in part.groupby(part["case_dtype"].astype(str), sort=True):
        strict = pd.to_numeric(rows["strict_ratio"], errors="coerce").dropna()
        if not strict.empty:
            shown.append(f"{dtype} {float(strict.max()):.3g}x ({int((strict > 1).sum())} of {len(strict)} past)")
    return ", ".join(shown)


def precision_lines(records: pd.DataFrame) -> list[str]:
    """The notes of ``precision_costs``, one line per backend that declares a working precision."""
    return [
        f"{row.backend}: {row.note}" + (f"; by input dtype: {row.by_dtype}" if row.by_dtype else "")
        for row in precision_costs(records).itertuples()
    ]
