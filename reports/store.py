"""The run store: a folder of runs, one immutable run file (plus its environment) per run.

Every run, from pytest (``--kda-out DIR``) or ``kda-conformance run --out DIR``, writes
``DIR/runs/<run_id>.parquet`` and ``<run_id>.env.json``, each by an atomic rename,
so a run killed midway leaves no half file and never touches an earlier run; rows measured before the
kill survive in ``<run_id>.partial.jsonl``. Loading takes every run it can read, marks killed runs
incomplete, and names every file it could not read (a torn line, a corrupt parquet) instead of stopping.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from kda_reports.findings import VERDICTS
from kda_reports.runfile import run_id_of

RUN_SUFFIXES = (".parquet", ".partial.jsonl")


@dataclass
class Store:
    records: pd.DataFrame  # every readable row of every run, oldest run first
    runs: pd.DataFrame  # one row per run: id, date, completeness, counts, environment
    problems: list[str] = field(default_factory=list)  # files skipped or partly read, and why


def _part(path: Path) -> str:
    """The run part a records file holds: its name without the suffix (``<run_id>`` or ``<run_id>.<part>``)."""
    name = path.name
    for suffix in RUN_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def _read_jsonl(path: Path, problems: list[str]) -> pd.DataFrame:
    rows, torn = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            torn += 1
    if torn:
        problems.append(f"{path.name}: {torn} unreadable line(s) skipped (a run killed while writing)")
    return pd.DataFrame(rows)


def load_store(root: Path) -> Store:
    """Every run under ``root`` (a store folder, or its ``runs`` folder)."""
    root = Path(root)
    runs_dir = root / "runs" if (root / "runs").is_dir() else root
    problems: list[str] = []
    frames, seen = [], set()
    paths = sorted(p for p in runs_dir.glob("*") if p.name.endswith(RUN_SUFFIXES) and not p.name.startswith("."))
    # A finished part's records win over its partial journal (normally removed when the part finishes).
    # The parts of one run id (the shards several hosts wrote) are one run.
    paths.sort(key=lambda p: (_part(p), p.name.endswith(".partial.jsonl")))
    for path in paths:
        part, run_id = _part(path), run_id_of(path)
        if part in seen:
            continue
        try:
            frame = pd.read_parquet(path) if path.suffix == ".parquet" else _read_jsonl(path, problems)
        except Exception as exc:  # a corrupt file must not stop the dashboard: name it and go on
            problems.append(f"{path.name}: not readable ({type(exc).__name__}: {str(exc)[:120]})")
            continue
        if frame.empty:
            problems.append(f"{path.name}: no records")
            continue
        seen.add(part)
        frame["run_id"] = run_id
        frame["env_complete"] = frame.get("env_complete", True)
        if path.name.endswith(".partial.jsonl"):
            frame["env_complete"] = False
            problems.append(f"{path.name}: a run that did not finish; its {len(frame)} records are shown as incomplete")
        frames.append(frame)
    records = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return Store(records, summarize_runs(records), problems)


ENV_SHOWN = ("env_date", "env_profile", "env_device_name", "env_arch", "env_suite_commit", "env_complete")


def summarize_runs(records: pd.DataFrame) -> pd.DataFrame:
    """One row per run, oldest first: its environment and how many records passed, failed, erred, skipped."""
    if records.empty:
        return pd.DataFrame(columns=["run_id", *ENV_SHOWN, *VERDICTS])
    counts = pd.crosstab(records["run_id"], records["verdict"])
    for verdict in VERDICTS:
        if verdict not in counts:
            counts[verdict] = 0
    env = records.groupby("run_id").first()[[c for c in ENV_SHOWN if c in records]]
    if "env_complete" in records:  # a run of several parts finished when every part did
        env["env_complete"] = records.groupby("run_id")["env_complete"].all()
    runs = env.join(counts[list(VERDICTS)]).reset_index()
    return runs.sort_values(["env_date", "run_id"] if "env_date" in runs else "run_id").reset_index(drop=True)
