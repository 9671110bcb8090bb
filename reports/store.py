"""The run store: a folder of runs, one immutable run file (plus its environment) per run.

Every run, from pytest (``--kda-out DIR``) or ``kda-conformance run --out DIR``, writes
``DIR/runs/<run_id>.parquet`` and ``<run_id>.env.json``, each by an atomic rename,
so a run killed midway leaves no half file and never touches an earlier run; rows measured before the
kill survive in ``<run_id>.partial.jsonl``. Loading takes every run it can read, marks killed runs
incomplete (and a run still running as in progress), and names every file and row it could not read (a
torn line, a corrupt parquet, a row that is not a record) instead of stopping.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd

from kda_reports.findings import VERDICTS
from kda_reports.quarantine import read_quarantine
from kda_reports.runfile import (
    JOURNAL_SUFFIX,
    RECORD_SUFFIXES,
    RECORDS_SUFFIX,
    RUN_FILE_SUFFIXES,
    journal_is_live,
    number,
    part_stem,
    read_journal,
    read_object,
    run_id_of,
)
from kda_reports.schema import REQUIRED_COLUMNS, validate_records

T = TypeVar("T")
D = TypeVar("D")


@dataclass
class Store:
    records: pd.DataFrame  # every readable row of every run, oldest run first
    runs: pd.DataFrame  # one row per run: id, date, completeness, counts, environment
    problems: list[str] = field(default_factory=list)  # files skipped or partly read, and why
    # One row per night part that ``kda-conformance nightly`` wrote (runs/<run>[.<part>].night.json): its wall
    # time, compile stage, workers and cache; and every (backend, configuration) it quarantined.
    nights: pd.DataFrame = field(default_factory=pd.DataFrame)
    quarantines: pd.DataFrame = field(default_factory=pd.DataFrame)

    @property
    def complete_runs(self) -> pd.DataFrame:
        """The runs that finished (every part of them), oldest first."""
        return self.runs[self.runs["status"] == COMPLETE].reset_index(drop=True)

    @property
    def judged_runs(self) -> pd.DataFrame:
        """The complete runs the headline, the regressions and ``--fail-on-flags`` judge, oldest first: the
        sweeps (SWEEP_PURPOSES); a store that holds no complete sweep judges every complete run."""
        complete = self.complete_runs
        sweeps = complete[complete["purpose"].isin(SWEEP_PURPOSES)].reset_index(drop=True)
        return sweeps if not sweeps.empty else complete

    def runs_sentence(self) -> str:
        """How many runs the store holds, counted as the dashboard judges them (the CLI and the page say the
        same): ``12 runs: 7 complete sweeps; apart: 3 minimize, 2 cases``."""
        judged = self.judged_runs
        kind = "sweep" if judged["purpose"].isin(SWEEP_PURPOSES).all() and not judged.empty else "run"
        text = f"{_count(len(self.runs), 'run')}: {_count(len(judged), 'complete ' + kind)} judged"
        apart = self.runs[~self.runs["run_id"].isin(judged["run_id"])]
        if not apart.empty:
            counts = apart.assign(what=apart["purpose"].where(apart["status"] == COMPLETE, apart["status"]))
            shown = counts["what"].value_counts()
            text += "; apart: " + ", ".join(f"{n} {what}" for what, n in shown.items())
        return text


class StoreError(ValueError):
    """The store cannot be read at all (a mistyped path); the message names it."""


def _said(exc: Exception, width: int = 160) -> str:
    """An exception in a few words, shortened at a word boundary."""
    return textwrap.shorten(f"{type(exc).__name__}: {exc}", width, placeholder=" ...")


def _valid(frame: pd.DataFrame, path: Path, problems: list[str]) -> pd.DataFrame:
    """The rows of ``frame`` that are records, field by field (schema.validate_records); the others named."""
    missing = [c for c in REQUIRED_COLUMNS if c not in frame]
    if missing:
        problems.append(f"{path.name}: not a run's records (no {', '.join(missing)} column); skipped")
        return frame.iloc[0:0]
    valid, skipped = validate_records(frame)
    problems += [f"{path.name}: {line}" for line in skipped]
    return valid


def _check_environment(path: Path, problems: list[str]) -> None:
    """A run's ``.env.json`` must be a JSON object naming the run; a torn or foreign one is named."""
    env_path = path.with_name(f"{part_stem(path)}.{RUN_FILE_SUFFIXES['environment']}")
    said: list[str] = []
    env = read_object(env_path, said)
    if said:
        problems += [f"{line}; the run's records carry its environment" for line in said]
    elif env is not None and env.get("run_id") != run_id_of(path):
        problems.append(f"{env_path.name}: not this run's environment (no run_id {run_id_of(path)})")


def _regular(paths: list[Path], problems: list[str]) -> list[Path]:
    """The regular files of ``paths``; anything else named like a run file (a FIFO, which a read would wait on
    forever; a folder; a device) is named in ``problems`` and skipped."""
    regular = [p for p in paths if p.is_file()]
    problems += [f"{p.name}: not a regular file; skipped" for p in paths if p not in regular]
    return regular


def load_store(root: Path) -> Store:
    """Every run under ``root`` (a store folder, or its ``runs`` folder). A folder that does not exist is an
    error (StoreError): a mistyped path must not read as an empty store."""
    root = Path(root)
    if not root.is_dir():
        raise StoreError(f"the store {str(root)!r} is not a folder: give the folder runs were written to")
    if (root / "runs").exists() and not (root / "runs").is_dir():
        raise StoreError(f"{str(root / 'runs')!r} is not a folder: a store keeps its runs in a folder of that name")
    runs_dir = root / "runs" if (root / "runs").is_dir() else root
    problems: list[str] = []
    frames, seen, live = [], set(), set()
    named = sorted(p for p in runs_dir.glob("*") if p.name.endswith(RECORD_SUFFIXES) and not p.name.startswith("."))
    paths = _regular(named, problems)
    # A finished part's records win over its partial journal (normally removed when the part finishes).
    # The parts of one run id (the shards several hosts wrote) are one run.
    paths.sort(key=lambda p: (part_stem(p), p.name.endswith(JOURNAL_SUFFIX)))
    for path in paths:
        part, run_id = part_stem(path), run_id_of(path)
        if part in seen:
            continue
        try:
            finished = path.name.endswith(RECORDS_SUFFIX)
            frame = pd.read_parquet(path) if finished else pd.DataFrame(read_journal(path, problems))
        except Exception as exc:  # a corrupt file must not stop the dashboard: name it and go on
            problems.append(f"{path.name}: not readable ({_said(exc)})")
            continue
        read = len(frame)
        frame = _valid(frame, path, problems)
        if frame.empty:
            if not read:
                problems.append(f"{path.name}: no records")
            continue
        seen.add(part)
        if path.name.endswith(RECORDS_SUFFIX):
            _check_environment(path, problems)
        frame["run_id"] = run_id
        frame["env_complete"] = [True if pd.isna(v) else bool(v) for v in frame["env_complete"]]
        if path.name.endswith(JOURNAL_SUFFIX):
            frame["env_complete"] = False
            if journal_is_live(path):
                live.add(run_id)
                problems.append(f"{path.name}: a run in progress; its {len(frame)} records so far are shown")
            else:
                problems.append(
                    f"{path.name}: a run that did not finish; its {len(frame)} records are shown as incomplete"
                )
        frames.append(frame)
    records = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    nights, quarantines = _nights(runs_dir, problems)
    return Store(records, summarize_runs(records, live), problems, nights, quarantines)


def _nights(runs_dir: Path, problems: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The nights' own files: each part's night.json, and each part's quarantine list. A night file without
    its wall time is skipped and named; a field of the wrong kind is left out and named."""
    nights = []
    for path in _regular(sorted(runs_dir.glob("*.night.json")), problems):
        night = read_object(path, problems)
        if night is None:
            continue
        wall = number(night.get("wall_seconds"))
        if wall is None:
            problems.append(f"{path.name}: no wall_seconds number; skipped")
            continue
        compiled = _field(night, "compile", dict, {}, path, problems)
        by_backend = _field(compiled, "seconds_by_backend", dict, {}, path, problems)
        nights.append(
            {
                "run_id": run_id_of(path),
                "part": _field(night, "part", str, "", path, problems),
                "wall_seconds": wall,
                "workers": _workers(night, path, problems),
                "compile_seconds": number(compiled.get("seconds")) or 0.0,
                "compile_wall_seconds": number(compiled.get("wall_seconds")) or 0.0,
                "compile_by_backend": {str(k): v for k, v in by_backend.items() if number(v) is not None},
                "kernel_configs": _field(night, "kernel_configs", int, None, path, problems),
                "cache": _field(_field(night, "cache", dict, {}, path, problems), "state", str, "", path, problems),
            }
        )
    quarantined = []
    for path in _regular(sorted(runs_dir.glob("*.quarantine.jsonl")), problems):
        # Two workers may have written the same configuration's crash: once each (backend, configuration).
        first: dict[tuple[str, str], object] = {}
        for entry in read_quarantine(path):
            first.setdefault((entry.backend, entry.config), entry)
        quarantined += [{"run_id": run_id_of(path), **entry.__dict__} for entry in first.values()]
    return pd.DataFrame(nights), pd.DataFrame(quarantined)


def _workers(night: dict, path: Path, problems: list[str]) -> int | str | None:
    """A night's workers: a number, or "auto" (pytest-xdist's own count); older night files wrote
    --workers N as text."""
    value = night.get("workers")
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return _field(night, "workers", int, None, path, problems)


def _field(data: dict[str, Any], name: str, kind: type[T], default: D, path: Path, problems: list[str]) -> T | D:
    """``data[name]`` where it is of ``kind`` (a number never a flag), else ``default``, named when present."""
    value = data.get(name)
    if value is None or (isinstance(value, kind) and not (kind is int and isinstance(value, bool))):
        return default if value is None else value
    problems.append(f"{path.name}: {name} is {type(value).__name__}, not {kind.__name__}; left out")
    return default


# What made a run (its environment's ``purpose``). The sweeps, a profile or grid over the backends (``run``
# without given cases, a pytest session, a night), are what the headline and the regressions judge; the
# others run given cases for a purpose of their own (a repro line pasted, minimize, triage's reruns,
# detection's planted bugs) and are listed apart, so a debugging run never becomes the headline.
SWEEP_PURPOSES = ("sweep", "nightly", "pytest")
OTHER_PURPOSES = ("cases", "minimize", "repro", "detection", "triage", "calibrate", "checks", "findings")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def run_purpose(purpose: object, command: object) -> str:
    """A run's purpose as its environment records it; for a run recorded before runs said so, read from its
    command line (given cases: ``--case``; else the ``kda-conformance`` subcommand; pytest; a sweep)."""
    if isinstance(purpose, str) and purpose:
        return purpose
    words = str(command).split() if isinstance(command, str) else []
    if "--case" in words:
        return "cases"
    if words[:1] == ["kda-conformance"] and len(words) > 1 and words[1] in OTHER_PURPOSES:
        return words[1]
    return "pytest" if words[:1] == ["pytest"] else "sweep"


ENV_SHOWN = ("env_date", "env_profile", "env_device_name", "env_arch", "env_suite_commit", "env_complete")
# A run's status: finished; stopped before its end (interrupted, or its process died); still being written.
COMPLETE, INCOMPLETE, IN_PROGRESS = "complete", "incomplete", "in progress"


def summarize_runs(records: pd.DataFrame, live: set[str] | frozenset[str] = frozenset()) -> pd.DataFrame:
    """One row per run, oldest first: its status (``live``: the runs a process is still writing), its
    environment and how many records passed, failed, erred, skipped."""
    if records.empty:
        return pd.DataFrame(columns=["run_id", "status", "purpose", *ENV_SHOWN, *VERDICTS])
    counts = pd.crosstab(records["run_id"], records["verdict"])
    for verdict in VERDICTS:
        if verdict not in counts:
            counts[verdict] = 0
    first = records.groupby("run_id").first()
    env = first[[c for c in ENV_SHOWN if c in records]]
    if "env_complete" in records:  # a run of several parts finished when every part did
        env["env_complete"] = records.groupby("run_id")["env_complete"].all()
    runs = env.join(counts[list(VERDICTS)]).reset_index()
    complete = runs["env_complete"].fillna(True).astype(bool) if "env_complete" in runs else True
    status = pd.Series(INCOMPLETE, index=runs.index).where(~complete, COMPLETE)
    runs.insert(1, "status", status.where(~runs["run_id"].isin(live), IN_PROGRESS))
    recorded = [first.get(c, pd.Series(index=first.index, dtype=object)) for c in ("env_purpose", "env_command")]
    purposes = {run: run_purpose(p, c) for run, p, c in zip(first.index, *recorded, strict=True)}
    runs.insert(2, "purpose", runs["run_id"].map(purposes))
    return runs.sort_values(["env_date", "run_id"] if "env_date" in runs else "run_id").reset_index(drop=True)
