"""One run, its files: records as parquet, the environment as JSON, and a readable summary.

A run is one invocation. A run split over processes or hosts is written in parts, each named
``<run_id>.<part>.*``; the controlling process of a pytest-xdist run merges its workers' parts into one
(``merge_parts``), and the store merges the parts of one run id that several hosts wrote. The locks on run
files live here too: the journal's while a part is written, and a run id's claim while a command writes it.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

import pandas as pd

from kda_cases.case import Case
from kda_cases.coverage import coverage, coverage_markdown
from kda_cases.files import atomic_write
from kda_reports.findings import SUITE_BACKEND, worst_ratio, writable
from kda_reports.schema import conform_records

DEFAULT_OUT = Path("out")


def new_run_id() -> str:
    """Sortable by time, unique across machines: ``20261130T051200Z-1a2b3c``."""
    return f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def run_stem(run_id: str, part: str | None = None) -> str:
    """The file name of a run (or of one part of it) without its suffix."""
    return f"{run_id}.{part}" if part else run_id


# Every file a run (or a part of it) keeps under ``<out>/runs``: ``<run_id>[.<part>].<suffix>``. Only this table
# spells the suffixes; everything else asks ``run_path`` / ``run_file`` for a path.
RUN_FILE_SUFFIXES = {
    "records": "parquet",
    "environment": "env.json",
    "partial": "partial.jsonl",
    "timing": "timing.json",
    "checks": "checks.json",
    "summary_md": "summary.md",
    "summary_csv": "summary.csv",
    "quarantine": "quarantine.jsonl",
    "night": "night.json",
}
# The two files that hold a run part's records: the finished part's, and the journal of one still running or killed.
RECORDS_SUFFIX, JOURNAL_SUFFIX = (f".{RUN_FILE_SUFFIXES[kind]}" for kind in ("records", "partial"))
RECORD_SUFFIXES = (RECORDS_SUFFIX, JOURNAL_SUFFIX)


def part_stem(path: Path) -> str:
    """The run (or part) a file of records holds: its name without the suffix (``<run_id>[.<part>]``)."""
    name = Path(path).name
    for suffix in RECORD_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return Path(path).stem


# What follows ``<run_id>.`` in a file of a whole run (otherwise it names a part: ``gw3``, ``s2of4-gw1``).
RUN_FILE_KINDS = tuple(dict.fromkeys(suffix.split(".")[0] for suffix in RUN_FILE_SUFFIXES.values()))


def run_path(out_dir: Path | str, stem: str, kind: str) -> Path:
    """The file of ``kind`` (a key of RUN_FILE_SUFFIXES) of the run or part named ``stem`` (``run_stem``)."""
    if kind not in RUN_FILE_SUFFIXES:
        raise ValueError(f"kind must be one of {', '.join(RUN_FILE_SUFFIXES)}, got {kind!r}")
    return Path(out_dir) / "runs" / f"{stem}.{RUN_FILE_SUFFIXES[kind]}"


def run_file(out_dir: Path | str, run_id: str, part: str | None, kind: str) -> Path:
    """Where a run (or its ``part``) keeps its file of ``kind``: ``<out>/runs/<run_id>[.<part>].<suffix>``."""
    return run_path(out_dir, run_stem(run_id, part), kind)


def run_files(out_dir: Path, run_id: str, part: str | None = None) -> list[Path]:
    """The files under ``out_dir/runs`` that a run ``run_id`` (or its ``part``) would write over: any file of
    the run id for a whole run; the whole run's and that part's (its workers' included) for a part."""
    runs = Path(out_dir) / "runs"
    found = []
    for path in sorted(runs.glob(f"{run_id}.*")):
        first = path.name[len(run_id) + 1 :].split(".", 1)[0]
        whole = first in RUN_FILE_KINDS
        if part is None or whole or first == part or first.startswith(f"{part}-"):
            found.append(path)
    return found


def run_id_of(path: Path) -> str:
    """The run a run file belongs to: its name up to the first dot (run ids hold none)."""
    return Path(path).name.split(".", 1)[0]


def read_object(path: Path, problems: list[str] | None = None) -> dict | None:
    """A run's JSON file (env, timing, night) as a mapping, or None where it cannot be one: a missing file
    is None quietly; an unreadable, torn, non-UTF-8 or non-object one is None and named in ``problems``."""
    try:
        data = json.loads(Path(path).read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        if problems is not None:
            problems.append(f"{Path(path).name}: not readable ({type(exc).__name__}: {str(exc)[:120]})")
        return None
    if not isinstance(data, dict):
        if problems is not None:
            problems.append(f"{Path(path).name}: not a JSON object ({type(data).__name__}); skipped")
        return None
    return data


def number(value: object) -> float | None:
    """``value`` as a float where it is a number (not a flag, not text), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def write_run(records: pd.DataFrame, env: dict, out_dir: Path, stem: str) -> dict[str, Path]:
    """Write ``runs/<stem>.parquet``, ``.env.json``, ``.summary.md`` and ``.csv`` under ``out_dir``."""
    (out_dir / "runs").mkdir(parents=True, exist_ok=True)
    paths = {kind: run_path(out_dir, stem, kind) for kind in ("records", "environment", "summary_md", "summary_csv")}
    atomic_write(paths["environment"], lambda p: p.write_text(json.dumps(env, indent=2, sort_keys=True)))
    atomic_write(paths["records"], lambda p: records.to_parquet(p, index=False))
    table = summary(records)
    atomic_write(paths["summary_csv"], lambda p: table.to_csv(p, index=False))
    reached = record_coverage(records)
    atomic_write(paths["summary_md"], lambda p: p.write_text(summary_markdown(table, env, stem, reached)))
    return paths


# Marker lines of a run's journal (``"journal": EVENT``) beside its records: a backend call starts
# ("call", with the error row it becomes if the process ends inside it), returns ("returned"), and its
# check's records are written ("settled"). A journal left by a process that died is read back
# (:func:`read_journal`) with a row for the call it died in: the backend's, or the suite's where the
# backend had returned.
JOURNAL = "journal"
CALL, RETURNED, SETTLED = "call", "returned", "settled"


class RunRecorder:
    """Writes one run as it goes: each batch of rows is appended to ``<run_id>.partial.jsonl`` at once,
    so a run that is killed (a time limit, a crashed GPU process) keeps every row measured so far;
    ``finish`` writes the run files and removes the partial one. The same journal holds the markers of
    the backend call in flight (:meth:`mark`).

    Rows are stamped with the run id and the environment (``env_*`` columns).
    """

    def __init__(self, env: dict, out_dir: Path, run_id: str | None = None, part: str | None = None) -> None:
        self.run_id = run_id or new_run_id()
        self.stem = run_stem(self.run_id, part)
        self.env = {**env, "run_id": self.run_id}
        self.out_dir = Path(out_dir)
        self.rows: list[dict] = []
        (self.out_dir / "runs").mkdir(parents=True, exist_ok=True)
        self.partial = run_path(self.out_dir, self.stem, "partial")
        self._live: IO[str] | None = None  # the journal, its lock held while the run runs (see journal_is_live)

    def _stamp(self, row: dict, env: dict) -> dict:
        return {**row, **{f"env_{k}": v for k, v in env.items()}, "run_id": self.run_id}

    def _journal(self) -> IO[str]:
        if self._live is None:
            self._live = self.partial.open("a", encoding="utf-8")
            fcntl.flock(self._live.fileno(), fcntl.LOCK_EX)
        return self._live

    def add(self, rows: list[dict]) -> None:
        self.rows.extend(rows)
        partial_env = {**self.env, "complete": False}
        journal = self._journal()
        for row in rows:
            journal.write(json.dumps(self._stamp(row, partial_env), default=str) + "\n")
        journal.flush()
        os.fsync(journal.fileno())

    def mark(self, event: str, call: str, row: dict | None = None) -> None:
        """A marker of backend call ``call``: ``CALL`` (``row``: the error it becomes should the process end
        inside it), ``RETURNED`` or ``SETTLED``. Flushed to the system, not synced: it must outlive the
        process, not the machine."""
        marker: dict = {JOURNAL: event, "call": call}
        if row is not None:
            marker["row"] = self._stamp(row, {**self.env, "complete": False})
        journal = self._journal()
        journal.write(json.dumps(marker, default=str) + "\n")
        journal.flush()

    def finish(self, complete: bool = True, timing: dict | None = None) -> tuple[pd.DataFrame, dict[str, Path]]:
        """Write the run files; ``timing`` (the suite's seconds per stage) goes to ``<stem>.timing.json``."""
        env = {**self.env, "complete": complete}
        frame = conform_records(pd.DataFrame([self._stamp(row, env) for row in self.rows]))
        paths = write_run(frame, env, self.out_dir, self.stem)
        if timing is not None:
            paths["timing"] = run_path(self.out_dir, self.stem, "timing")
            atomic_write(paths["timing"], lambda p: p.write_text(json.dumps(timing, indent=1)))
        self.partial.unlink(missing_ok=True)
        if self._live is not None:
            self._live.close()
            self._live = None
        return frame, paths


def read_journal(path: Path, problems: list[str] | None = None) -> list[dict]:
    """The records of a run's journal, line by line: a line that is not UTF-8, not JSON (torn by a kill) or
    not an object is skipped and counted in ``problems``, never the whole file. A backend call that started
    and never settled becomes an error row: the backend's when the process ended inside its call, the
    suite's when it ended after the call returned."""
    rows: list[dict] = []
    calls: dict[str, dict] = {}  # call id -> {"row": ..., "state": ...}
    undecodable = torn = shapeless = 0
    with open(path, "rb") as handle:
        for raw in handle:
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                undecodable += 1
                continue
            try:
                # An escaped lone surrogate ("\udcff") decodes to a string no writer takes: kept as its escape.
                item = json.loads(line, object_hook=lambda pairs: {k: writable(v) for k, v in pairs.items()})
            except ValueError:
                torn += 1
                continue
            if not isinstance(item, dict):
                shapeless += 1
            elif JOURNAL in item:
                entry = calls.setdefault(str(item.get("call")), {"row": None, "state": None})
                if isinstance(item.get("row"), dict):
                    entry["row"] = item["row"]
                entry["state"] = item[JOURNAL]
            else:
                rows.append(item)
    for entry in calls.values():
        if entry["row"] is not None and entry["state"] in (CALL, RETURNED):
            rows.append(entry["row"] if entry["state"] == CALL else _suite_row(entry["row"]))
    said = {
        undecodable: "not UTF-8",
        torn: "unreadable (torn by a process killed while writing)",
        shapeless: "JSON, but not a record (an object)",
    }
    if problems is not None:
        problems += [f"{Path(path).name}: {n} line(s) skipped: {why}" for n, why in said.items() if n]
    return rows


def _suite_row(row: dict) -> dict:
    """The error row of a process that ended in the suite's own code after a backend's call returned."""
    backend = row.get("backend")
    reason = f"the process ended in the suite's own code after {backend}'s call returned (check {row.get('check')})"
    return {**row, "backend": SUITE_BACKEND, "reason": reason}


def journal_is_live(path: Path) -> bool:
    """Whether a run's ``.partial.jsonl`` belongs to a run still running: its process holds the journal's
    lock, which the system releases when the process ends, however it ends."""
    try:
        with open(path) as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def merge_parts(out_dir: Path, stem: str, parts: str, env: dict, timing: dict | None) -> tuple[pd.DataFrame, dict]:
    """Merge the run parts ``runs/<parts>*`` (the workers' parts of one run: finished ones' parquet, a
    crashed one's journal) into the run files of ``stem``, and remove them. The merged records carry
    ``env``'s completeness: the run finished even where one worker did not."""
    runs = Path(out_dir) / "runs"
    frames, done = [], set()
    records = sorted(runs.glob(f"{parts}*{RECORDS_SUFFIX}")) + sorted(runs.glob(f"{parts}*{JOURNAL_SUFFIX}"))
    for path in records:
        part = part_stem(path)
        if part not in done:  # a finished part's parquet wins over its journal
            done.add(part)
            frames.append(read_run(path))
    frame = conform_records(pd.concat(frames, ignore_index=True) if frames else pd.DataFrame())
    if not frame.empty:
        frame["env_complete"] = env.get("complete", True)
    paths = write_run(frame, env, Path(out_dir), stem)
    if timing is not None:
        paths["timing"] = run_path(out_dir, stem, "timing")
        atomic_write(paths["timing"], lambda p: p.write_text(json.dumps(timing, indent=1)))
    for leftover in runs.glob(f"{parts}*"):
        leftover.unlink(missing_ok=True)
    return frame, paths


def read_run(path: Path) -> pd.DataFrame:
    """The records of one run file (parquet, or a killed run's ``.partial.jsonl``: :func:`read_journal`)."""
    path = Path(path)
    if path.name.endswith(JOURNAL_SUFFIX):
        return conform_records(pd.DataFrame(read_journal(path)))
    return conform_records(pd.read_parquet(path))


SUMMARY_COLUMNS = [
    "case_id",
    "label",
    "backend",
    "tensor",
    "verdict",
    "max_abs",
    "budget",
    "ratio",
    "rel_rms",
    "rel_rms_ratio",
    "seconds",
]
WORST_SHOWN = 10


def summary(records: pd.DataFrame) -> pd.DataFrame:
    """One line per case x backend x tensor with the headline numbers."""
    cols = [c for c in SUMMARY_COLUMNS if c in records.columns]
    if records.empty:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    return records[cols].sort_values(["backend", "case_id", "tensor"], kind="stable").reset_index(drop=True)


def summary_markdown(table: pd.DataFrame, env: dict, run_id: str, coverage_table: pd.DataFrame | None = None) -> str:
    counts = table["verdict"].value_counts().to_dict() if len(table) else {}
    head = [
        f"# KDA conformance run {run_id}",
        "",
        f"Device: {env.get('device_name', '')} ({env.get('device_type', '')}, {env.get('arch', '')}); "
        f"torch {env.get('torch', '')}, triton {env.get('triton', '')}, fla {env.get('fla', '')}; "
        f"suite {env.get('suite_commit', '')}.",
        "",
        "Verdicts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
        "",
    ]
    if env.get("profile"):
        seed = env.get("seed")
        head[-1:-1] = [
            f"Profile {env['profile']}" + (f", seed {seed}." if seed not in (None, "") else ", derandomized.")
        ]
    worst = []
    if {"ratio", "rel_rms_ratio"} <= set(table.columns) and len(table):
        ranked = table.assign(worst=worst_ratio(table["ratio"], table["rel_rms_ratio"])).dropna(subset=["worst"])
        top = ranked.sort_values("worst", ascending=False).head(WORST_SHOWN).drop(columns="worst")
        worst = ["## Worst cases (largest error / limit)", "", _formatted(top).to_markdown(index=False), ""]
    every = ["## Every record", "", _formatted(table).to_markdown(index=False), ""]
    reached = []
    if coverage_table is not None and len(coverage_table):
        reached = ["## Axis coverage (distinct cases per value)", "", coverage_markdown(coverage_table), ""]
    return "\n".join(head + worst + reached + every)


def record_coverage(records: pd.DataFrame) -> pd.DataFrame:
    """The axis coverage (cases/coverage.py) of the distinct cases of a run's records."""
    if records.empty or "case_json" not in records:
        return coverage([])
    return coverage(Case.from_json(text) for text in records["case_json"].dropna().unique())


def _formatted(table: pd.DataFrame) -> pd.DataFrame:
    shown = table.copy()
    for col in ("max_abs", "budget", "rel_rms"):
        if col in shown:
            shown[col] = shown[col].map(lambda x: f"{x:.3g}" if pd.notna(x) else "")
    for col in ("ratio", "rel_rms_ratio", "seconds"):
        if col in shown:
            shown[col] = shown[col].map(lambda x: f"{x:.2f}" if pd.notna(x) else "")
    return shown


# The run ids this process holds: each claim file's open handle, its lock held until release_claims().
_claims: dict[Path, IO[str]] = {}


def claim_run(out: Path, stem: str) -> str | None:
    """Claim the run (or part) ``stem`` in ``out`` for this process, or say who holds it. Two runs given one
    id at once both saw no file of it and both wrote, the second's parquet replacing the first's: a claim is
    an exclusive lock on ``runs/.<stem>.claim``, taken or refused at once and let go when the command ends
    (:func:`release_claims`) or its process does (a killed run leaves no stale claim; what it wrote refuses
    the id by itself)."""
    path = out / "runs" / f".{stem}.claim"
    if path in _claims:
        return None
    handle = path.open("a+", encoding="utf-8")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        return f"is being written to {out} by another process ({holder})"
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}")
    handle.flush()
    _claims[path] = handle
    return None


def release_claims() -> None:
    """Let go of every run id this process claimed (its command is over: what it wrote, if anything, now
    refuses the id by itself). The file goes first, then the lock, so no one can take a lock on a file
    that is about to be removed and still count as holding the id."""
    for path, handle in list(_claims.items()):
        path.unlink(missing_ok=True)
        handle.close()
        del _claims[path]
