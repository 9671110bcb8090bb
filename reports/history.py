"""How long a red has been red: the history of each cell (backend, check, GPU model) over a store's nights.

For each cell, over the judged runs that hold it (kda_reports.store: complete sweeps, oldest first): its status
tonight (red where a record failed or erred, green where some passed or were known and none did, else not run),
its current streak (nights in a row at tonight's status), the last green night, the flips (changes of status)
over the last ``window`` nights, flaky where they reach ``FLAKY_FLIPS``, and for a cell red tonight the night its
streak began, what changed since the last green night (environment, suite commit, seed; regressions.py's own
words) and the suite commits a bisect would start from. What vLLM's AMD CI tracker lists per test, and PyTorch's
nightly flags as "passing yesterday, failing today".
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pandas as pd

from kda_reports.regressions import environment_change
from kda_reports.store import Store

RED, GREEN, NOT_RUN = "red", "green", "not run"
FAILED = ("fail", "error")
PASSED = ("pass", "known", "warn")
FLAKY_FLIPS = 3  # flips within the window that make a cell flaky, apart from a regression
NOT_A_KERNEL = ("(suite)",)
COLUMNS = ["backend", "check", "device", "tonight", "streak", "last_green", "flips", "flaky", "first_red",
           "changed", "bisect"]  # fmt: skip


def _status(verdicts: pd.Series) -> str:
    if verdicts.isin(FAILED).any():
        return RED
    return GREEN if verdicts.isin(PASSED).any() else NOT_RUN


def cell_history(store: Store, window: int = 10) -> pd.DataFrame:
    """One row per (backend, check, device model) the store's judged runs hold (see the module's docstring)."""
    runs = store.judged_runs
    order = {run_id: n for n, run_id in enumerate(runs["run_id"])}
    records = store.records[
        store.records["run_id"].isin(order) & ~store.records["backend"].astype(str).isin(NOT_A_KERNEL)
    ]
    if records.empty:
        return pd.DataFrame(columns=COLUMNS)
    device = records["env_device_name"].fillna("").astype(str) if "env_device_name" in records else ""
    cells = records.assign(device=device).groupby(["backend", "check", "device", "run_id"])["verdict"].agg(_status)
    commits = runs.set_index("run_id")["env_suite_commit"] if "env_suite_commit" in runs else pd.Series(dtype=str)
    rows = []
    for (backend, check, device_name), nights in cells.groupby(level=[0, 1, 2]):
        statuses = nights.droplevel([0, 1, 2])
        statuses = statuses[statuses != NOT_RUN].sort_index(key=lambda ids: ids.map(order))
        if statuses.empty:
            continue
        ids, values = list(statuses.index), list(statuses)
        tonight, streak = values[-1], 1
        while streak < len(values) and values[-1 - streak] == tonight:
            streak += 1
        greens = [run for run, status in zip(ids, values, strict=True) if status == GREEN]
        last_green = greens[-1] if greens else ""
        recent = values[-window:]
        flips = sum(a != b for a, b in itertools.pairwise(recent))
        first_red = ids[-streak] if tonight == RED else ""
        changed = bisect = ""
        if first_red and last_green:
            changed = environment_change(runs, last_green, first_red)
            bisect = f"{commits.get(last_green, '?')}..{commits.get(first_red, '?')}"
        rows.append([backend, check, device_name, tonight, streak, last_green, flips, flips >= FLAKY_FLIPS,
                     first_red, changed, bisect])  # fmt: skip
    return pd.DataFrame(rows, columns=COLUMNS)


def red_first(history: pd.DataFrame) -> pd.DataFrame:
    """The cells red tonight first, then by backend, check and device (the terminal's and the dashboard's order)."""
    order = history.assign(_green=history["tonight"] != RED).sort_values(["_green", "backend", "check", "device"])
    return order.drop(columns="_green")


def history_lines(history: pd.DataFrame) -> list[str]:
    """The history as a terminal prints it: the red cells first, the flaky ones marked."""
    lines = []
    for row in red_first(history).itertuples():
        night = "night" if row.streak == 1 else "nights"
        text = f"{row.backend} / {row.check} / {row.device or '-'}: {row.tonight} for {row.streak} {night}"
        text += f"; last green {row.last_green or 'never'}; {row.flips} flips" + (" (flaky)" if row.flaky else "")
        if row.first_red:
            text += f"; red since {row.first_red}"
            text += f" ({row.changed}; bisect {row.bisect})" if row.changed else ""
        lines.append(text)
    return lines


EXPECTED_COLUMNS = ["backend", "check", "device", "expected", "reason"]


def read_expected(path: Path) -> pd.DataFrame:
    """A team's expected-status file: CSV with backend, check, device (a GPU model, or empty for any),
    expected (red or green) and reason (the ledger entry or the words that say why a cell is expected red)."""
    table = pd.read_csv(path, dtype=str, keep_default_na=False)
    missing = [c for c in EXPECTED_COLUMNS if c not in table.columns]
    if missing:
        raise ValueError(f"{path}: no column {', '.join(missing)} (it needs {', '.join(EXPECTED_COLUMNS)})")
    bad = sorted(set(table["expected"]) - {RED, GREEN})
    if bad:
        raise ValueError(f"{path}: expected {bad} not allowed; choose red or green")
    return table[EXPECTED_COLUMNS]


def departures(history: pd.DataFrame, expected: pd.DataFrame) -> list[str]:
    """The cells whose status tonight is not the one the file expects, each said with the file's reason; a
    cell the file does not list is expected green."""
    said = []
    for row in history.itertuples():
        listed = expected[
            (expected["backend"] == row.backend)
            & (expected["check"] == row.check)
            & expected["device"].isin([row.device, ""])
        ]
        want = listed["expected"].iloc[0] if not listed.empty else GREEN
        if row.tonight in (RED, GREEN) and row.tonight != want:
            reason = listed["reason"].iloc[0] if not listed.empty else "not listed: expected green"
            said.append(f"{row.backend} / {row.check} / {row.device or '-'}: {row.tonight}, expected {want} ({reason})")
    return said


def tonight_departures(store: Store, expected: pd.DataFrame) -> list[str]:
    """:func:`departures` of the store's newest judged run, over that run's backends only (an earlier night's
    others are not tonight's): what ``nightly --expected`` and ``pytest --kda-expected`` fail on."""
    history = cell_history(store)
    if not store.judged_runs.empty:
        tonight = store.records[store.records["run_id"] == store.judged_runs["run_id"].iloc[-1]]
        history = history[history["backend"].isin(tonight["backend"])]
    return departures(history, expected)


def expected_from(history: pd.DataFrame, reasons: dict[tuple[str, str], str]) -> pd.DataFrame:
    """The expected-status file tonight's statuses make (``--update-expected``), red cells with the ledger entry
    their records name where there is one (``reasons``, by backend and check)."""
    rows = history[history["tonight"].isin([RED, GREEN])]
    return pd.DataFrame(
        {
            "backend": rows["backend"],
            "check": rows["check"],
            "device": rows["device"],
            "expected": rows["tonight"],
            "reason": [
                reasons.get((b, c), "") if t == RED else ""
                for b, c, t in zip(rows["backend"], rows["check"], rows["tonight"], strict=True)
            ],
        }
    )[EXPECTED_COLUMNS]
