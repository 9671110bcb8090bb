"""Regressions over a store's history: per backend x check x case family x tensor, tonight against recent
nights.

A night's figure for a group is its worst error/limit ratio (the larger of the max-abs and rel-RMS ratios;
1 is the limit) and whether any case failed or erred. The latest run is compared with the median of the
``window`` runs before it: a group that fails tonight and passed in the previous run (or was not
measured in it) is a new failure,
one that passed tonight and failed in the previous run is fixed, and one whose worst ratio grew past
``growth`` times the median (and above ``floor``, below which ratios are noise) has grown. Each flag
says what changed between the two runs: the environment (library versions, GPU, CUDA/HIP), the suite's
commit, or neither (a new seed drew harder cases, or the kernel is not deterministic).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any, cast

import pandas as pd

from kda_cases.sentinels import SENTINEL_GROWTH, sentinel_ids
from kda_reports.findings import FAILED, worst_ratios

ENV_KEYS = {
    "env_torch": "torch",
    "env_triton": "triton",
    "env_fla": "fla",
    "env_aiter": "aiter",
    "env_device_name": "device",
    "env_arch": "arch",
    "env_cuda": "CUDA",
    "env_hip": "HIP",
    "env_multiprocessors": "SMs/CUs",
    "env_variables": "variables",
    "env_libraries": "libraries",
}
GROUP = ["backend", "check", "family", "tensor"]


def longest(records: pd.DataFrame) -> pd.Series:
    """Each record's longest sequence (tokens)."""
    return records["case_seq_lens"].map(lambda lens: max(_lengths(lens), default=0))


def record_worst(records: pd.DataFrame) -> pd.Series:
    """Each record's error/limit: the larger of the max-abs and rel-RMS ratios; inf where the backend erred."""
    return worst_ratios(records).where(records["verdict"] != "error", math.inf)


def family(records: pd.DataFrame) -> pd.Series:
    """The case family of each record: input dtype, gate regime, a power-of-two length bucket and the kernel
    shape (heads, K and V), so that a night of K = 7 is never judged against a history of K = 64."""
    bucket = longest(records).map(lambda n: f"T<={2 ** math.ceil(math.log2(n))}" if n > 1 else "T<=1")

    def text(column: str) -> pd.Series:
        values = records[column] if column in records else pd.Series("?", index=records.index)
        return values.map(lambda v: "?" if pd.isna(v) else f"{int(v)}" if isinstance(v, float) else str(v))

    shape = "H" + text("case_num_heads") + "/" + text("case_num_v_heads")
    shape += " K" + text("case_head_k_dim") + "V" + text("case_head_v_dim")
    return text("case_dtype") + " " + text("case_gate_regime") + " " + bucket + " " + shape


def _lengths(value: object) -> list[int]:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return []
    if isinstance(value, str):
        return [int(x) for x in value.strip("[]() ").replace(",", " ").split()]
    return [int(x) for x in cast(Iterable[Any], value)]


def nightly_groups(records: pd.DataFrame) -> pd.DataFrame:
    """Per run x backend x family x tensor: cases, failures, worst ratio, and the worst case's repro."""
    measured = records[records["verdict"].isin(["pass", *FAILED, "warn", "known", "marginal"])].copy()
    if measured.empty:
        return pd.DataFrame(columns=["run_id", *GROUP, "cases", "failed", "worst", "repro", "case_id"])
    measured["check"] = measured["check"].fillna("budget") if "check" in measured else "budget"
    measured["family"] = family(measured)
    measured["tensor"] = measured["tensor"].fillna("").replace("", "(run)")
    measured["worst"] = record_worst(measured)
    measured["failed"] = measured["verdict"].isin(FAILED)
    measured = measured.sort_values("worst", ascending=False)
    grouped = measured.groupby(["run_id", *GROUP], sort=False)
    table = grouped.agg(
        cases=("case_id", "nunique"),
        failed=("failed", "sum"),
        worst=("worst", "max"),
        repro=("repro", "first"),
        case_id=("case_id", "first"),
    )
    return table.reset_index()


def _json(text: object) -> dict:
    try:
        value = json.loads(str(text))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def environment_change(runs: pd.DataFrame, before: str, after: str) -> str:
    """What differs between two runs: environment, suite commit, or neither."""
    a = runs.set_index("run_id").loc[before]
    b = runs.set_index("run_id").loc[after]
    changes = [
        f"{label} {a[key]} -> {b[key]}"
        for key, label in ENV_KEYS.items()
        if key in runs and key != "env_libraries" and str(a[key]) != str(b[key])
    ]
    if "env_libraries" in runs:  # the libraries both runs used, by name (a run of other backends changes none)
        before_libs, after_libs = _json(a["env_libraries"]), _json(b["env_libraries"])
        changes += [
            f"{name} {before_libs[name]} -> {after_libs[name]}"
            for name in sorted(set(before_libs) & set(after_libs))
            if before_libs[name] != after_libs[name]
        ]
    suite = "env_suite_commit" in runs and str(a["env_suite_commit"]) != str(b["env_suite_commit"])
    seed = "env_seed" in runs and _shown(a["env_seed"]) != _shown(b["env_seed"])
    parts = []
    if changes:
        parts.append("environment: " + ", ".join(changes))
    if suite:
        parts.append(f"suite: {a['env_suite_commit']} -> {b['env_suite_commit']}")
    if seed:
        parts.append(f"seed: {_shown(a['env_seed'])} -> {_shown(b['env_seed'])} (other cases drawn)")
    return "; ".join(parts) or "no change of environment, suite or seed (nondeterminism, or a flaky kernel)"


def code_changes(records: pd.DataFrame, before: str, after: str) -> dict[str, str]:
    """The backends whose own source (``backend_code``) differs between two runs: ``{backend: "its code changed
    (a1 -> b2)"}``. Records of older runs hold no hash: nothing is said of those."""
    if "backend_code" not in records:
        return {}
    code = records[records["run_id"].isin([before, after])].dropna(subset=["backend_code"])
    code = code[code["backend_code"].astype(str) != ""]
    hashes = code.groupby(["backend", "run_id"])["backend_code"].first().unstack()
    if before not in hashes or after not in hashes:
        return {}
    moved = hashes.dropna(subset=[before, after])
    moved = moved[moved[before] != moved[after]]
    return {backend: f"the backend's code changed ({row[before]} -> {row[after]})" for backend, row in moved.iterrows()}


def _with_code(cause: str, backend: str, changed: dict[str, str]) -> str:
    """``cause`` with the backend's own code change first, where its code changed (then it is not "no change")."""
    if backend not in changed:
        return cause
    return changed[backend] if cause.startswith("no change") else f"{changed[backend]}; {cause}"


def _shown(value: object) -> str:
    """A recorded value as text: a seed read back as 7.0 is 7; a missing one is 'derandomized'."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value == "":
        return "derandomized"
    return f"{int(value)}" if isinstance(value, float) and value.is_integer() else str(value)


def sentinel_worst(records: pd.DataFrame) -> pd.DataFrame:
    """Per run x backend x sentinel x tensor: the worst error/limit (the sentinels' own trends)."""
    ids = sentinel_ids()
    judged = records["verdict"].isin(["pass", *FAILED, "warn", "known", "marginal"])
    measured = records[records["case_id"].isin(ids) & judged]
    if measured.empty:
        return pd.DataFrame(columns=["run_id", "backend", "case_id", "label", "tensor", "worst", "repro"])
    measured = measured.assign(worst=record_worst(measured), tensor=measured["tensor"].fillna("").replace("", "(run)"))
    grouped = measured.groupby(["run_id", "backend", "case_id", "tensor"], sort=False)
    return grouped.agg(worst=("worst", "max"), label=("label", "first"), repro=("repro", "first")).reset_index()


def sentinel_flags(records: pd.DataFrame, runs: list[str], cause: str, growth: float = SENTINEL_GROWTH) -> list[dict]:
    """ "sentinel growth" flags: a sentinel whose error/limit tonight (the last of ``runs``) passed ``growth``
    times its median over the earlier ``runs``, within its budget or not. Same inputs every night, so for a
    deterministic kernel any growth is the kernel's (or its environment's)."""
    trends = sentinel_worst(records[records["run_id"].isin(runs)])
    if trends.empty:
        return []
    tonight = trends[trends["run_id"] == runs[-1]]
    before = trends[trends["run_id"] != runs[-1]].groupby(["backend", "case_id", "tensor"])["worst"].median()
    flags = []
    for row in tonight.to_dict("records"):
        median = before.get((row["backend"], row["case_id"], row["tensor"]), math.nan)
        if median > 0 and math.isfinite(median) and row["worst"] > growth * median:
            flags.append(
                {
                    "kind": "sentinel growth",
                    "backend": row["backend"],
                    "check": "budget",
                    "family": f"sentinel {row['label']}",
                    "tensor": row["tensor"],
                    "tonight": row["worst"],
                    "before": median,
                    "cause": cause,
                    "case_id": row["case_id"],
                    "repro": row["repro"],
                }
            )
    return flags


def find_regressions(
    records: pd.DataFrame,
    runs: pd.DataFrame,
    window: int = 5,
    growth: float = 1.5,
    floor: float = 0.1,
    sentinel_growth: float = SENTINEL_GROWTH,
) -> pd.DataFrame:
    """Flags for the latest run against the ``window`` runs before it (see the module's docstring)."""
    columns = ["kind", *GROUP, "tonight", "before", "cause", "case_id", "repro"]
    env_runs = runs.copy()
    for key in [*ENV_KEYS, "env_suite_commit", "env_seed"]:
        if key in records and key not in env_runs:
            env_runs = env_runs.merge(records.groupby("run_id")[key].first().reset_index(), on="run_id", how="left")
    order = list(runs["run_id"])
    if len(order) < 2:
        return pd.DataFrame(columns=columns)
    latest, previous, history = order[-1], order[-2], order[-1 - window : -1]
    groups = nightly_groups(records)
    now = groups[groups["run_id"] == latest].set_index(GROUP)
    past = groups[groups["run_id"].isin(history)]
    last = groups[groups["run_id"] == previous].set_index(GROUP)
    median = past.groupby(GROUP)["worst"].median()
    cause = environment_change(env_runs, previous, latest)
    changed = code_changes(records, previous, latest)
    flags = []
    for key, row in now.iterrows():
        before = median.get(key, math.nan)
        was = last.loc[key] if key in last.index else None
        entry = {
            "tonight": row["worst"],
            "before": before,
            "cause": cause,
            "case_id": row["case_id"],
            "repro": row["repro"],
        }
        if was is None:  # a backend, check or case family new tonight: nothing to compare it with
            if row["failed"]:
                new = "not measured in the run before (a new backend, check or case family)"
                flags.append({"kind": "new", **dict(zip(GROUP, key, strict=True)), **entry, "cause": new})
        elif row["failed"] and not was["failed"]:
            flags.append({"kind": "new failure", **dict(zip(GROUP, key, strict=True)), **entry})
        elif row["worst"] > floor and before > 0 and row["worst"] > growth * before:
            flags.append({"kind": "error growth", **dict(zip(GROUP, key, strict=True)), **entry})
    flags += sentinel_flags(records, order[-1 - window :], cause, sentinel_growth)
    for key, was in last.iterrows():
        if was["failed"] and key in now.index and not now.loc[key]["failed"]:
            entry = {"tonight": now.loc[key]["worst"], "before": median.get(key, math.nan), "cause": cause}
            flags.append({"kind": "fixed", **dict(zip(GROUP, key, strict=True)), **entry, "case_id": "", "repro": ""})
    for flag in flags:  # every kind of flag, sentinels' and fixes' too, says when its backend's code changed
        flag["cause"] = _with_code(flag["cause"], flag["backend"], changed)
    return pd.DataFrame(flags, columns=columns)
