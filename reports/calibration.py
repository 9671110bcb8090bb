"""The calibration table: how close each backend comes to its limits over a grid of cases.

``kda-conformance calibrate`` runs the calibration grid (``cases/grids.py``: lengths x dtypes x gate
regimes x with and without an initial state) through the selected backends, keeps the run file like any
run, and summarizes per backend, dtype and tensor: the worst error/limit ratio (must stay below 1 with
margin for a correct kernel) and what would happen to the same kernel with its error doubled (an error
exactly twice as large everywhere: both metrics double), which the rule must catch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import pandas as pd

from kda_reports.findings import worst_ratio


def calibration_table(records: pd.DataFrame) -> pd.DataFrame:
    """Per backend x dtype x tensor: cases, worst ratios, and the verdict at twice the error."""
    if "verdict" not in records:
        return pd.DataFrame()
    ran = records[records["verdict"].isin(["pass", "fail"])].copy()
    if ran.empty:
        return pd.DataFrame()
    ran["worst"] = worst_ratio(ran["ratio"], ran["rel_rms_ratio"])
    # Doubling the error doubles both metrics; the hard checks do not change.
    ran["doubled_fails"] = (ran["verdict"] == "fail") | (2 * ran["worst"] > 1)
    grouped = ran.groupby(["backend", "case_dtype", "tensor"], sort=True)
    table = grouped.agg(
        cases=("case_id", "nunique"),
        lengths=("case_total_tokens", lambda s: f"{s.min()}..{s.max()}"),
        fails=("verdict", lambda s: int((s == "fail").sum())),
        worst_max_abs=("max_abs", "max"),
        worst_ratio=("ratio", "max"),
        worst_rel_rms_ratio=("rel_rms_ratio", "max"),
        median_worst=("worst", "median"),
        doubled_fail_share=("doubled_fails", "mean"),
    ).reset_index()
    table = table.rename(columns={"case_dtype": "dtype"})
    table["doubled_caught"] = table["doubled_fail_share"] > 0
    return table


def calibration_markdown(table: pd.DataFrame, commands: Sequence[str], env: dict) -> str:
    """The summary table as committed to docs, with the command and machine that produced it."""
    if table.empty:
        return f"Produced by {', '.join(commands)}: no backend ran a case.\n"
    shown = table.copy()
    for col in ("worst_max_abs",):
        shown[col] = shown[col].map(lambda x: f"{x:.2e}")
    for col in ("worst_ratio", "worst_rel_rms_ratio", "median_worst"):
        shown[col] = shown[col].map(lambda x: f"{x:.2f}")
    shown["doubled_fail_share"] = shown["doubled_fail_share"].map(lambda x: f"{100 * x:.0f} %")
    shown["doubled_caught"] = shown["doubled_caught"].map({True: "yes", False: "no"})
    # Where a run wrote its files is not part of how it measured (and names a machine's folders).
    shown_commands = [re.sub(r"\s--out(=|\s+)\S+", "", c) for c in commands]
    head = [
        "# Calibration of the tolerance rule",
        "",
        "Produced by " + " and ".join(f"`{c}`" for c in shown_commands) + ",",
        f"on {env.get('device_name', '')} ({env.get('arch', '')}, {env.get('multiprocessors', '')} SMs/CUs), "
        f"torch {env.get('torch', '')}, triton {env.get('triton', '')}, fla {env.get('fla', '')}, "
        f"suite {env.get('suite_commit', '')}, {env.get('date', '')}.",
        "",
        "Ratios are error / limit (below 1 passes); `worst` is the larger of the max-abs and rel-RMS ratios. "
        "`doubled_fail_share` is the share of cases that fail when the backend's error is doubled; "
        "`doubled_caught` says whether the doubled backend fails the sweep.",
        "",
    ]
    return "\n".join(head) + shown.to_markdown(index=False) + "\n"
