"""The detection table: which check caught which backend's bug, after how many cases, and where.

It is built from a run's example log (``<run_id>.checks.json``: per pytest test, its check and backend,
the examples Hypothesis ran until the first failure, and that failure's findings), which the pytest
plugin writes. Pointed at the planted-bug zoo it measures the suite's sensitivity; pointed at correct
backends, its specificity (docs/detection.md).
"""

from __future__ import annotations

import textwrap
from collections.abc import Collection, Mapping

import pandas as pd

from kda_reports.findings import Finding, worst_ratios

CORPUS = "corpus"  # the log's name for the pinned-case tests (the budget check on every corpus case)
COLUMNS = ["backend", "caught by", "cases run", "first bad", "worst ratio"]


def first_location(entry: dict) -> str:
    """The first bad point of an entry's first failure: the first failed finding that has one."""
    for data in entry.get("findings", []):
        finding = Finding.from_dict(data)
        if finding.failed and finding.first_bad is not None:
            return str(finding.first_bad)
    return ""


def _first_line(entries: list[dict]) -> str:
    for entry in entries:
        if entry["failed_at"] is not None and entry.get("findings"):
            line = Finding.from_dict(entry["findings"][0]).message(repro=False).splitlines()[0]
            return textwrap.shorten(line, 80, placeholder=" ...")
    return "no finding"


def worst_ratio_of(records: pd.DataFrame | None, backend: str) -> str:
    """The worst error/limit over ``backend``'s judged records (max-abs or rel-RMS, whichever is larger): how
    close a correct control came to its limits, how far past them a planted bug went. Records the ledger
    claims (``known``) are left out and counted: a library's known bug is not its margin (FLA's in-place
    cu_seqlens records are inf in the CPU interpreter)."""
    if records is None or records.empty or "backend" not in records:
        return "-"
    own = records[records["backend"].astype(str) == backend]
    known = own["verdict"].astype(str) == "known" if "verdict" in own else pd.Series(False, own.index)
    ratios = worst_ratios(own[~known]).dropna()
    worst = "-" if ratios.empty else f"{float(ratios.max()):.3g}"
    return f"{worst} ({int(known.sum())} known left out)" if known.any() else worst


def detection_table(
    entries: Mapping[str, dict],
    backends: list[str],
    titles: Mapping[str, str],
    records: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Per backend: the checks that flagged it (``titles``: check name -> title, in table order) with the
    case at which each first failed, the cases run, the first bad point of the first check that failed, and
    the worst error/limit of its records in the run (``records``, where given)."""
    order = list(titles)
    rows = []
    for backend in backends:
        mine = [e for e in entries.values() if e["backend"] == backend]
        corpus = [e for e in mine if e["check"] == CORPUS and e["examples"]]  # not the skipped ones
        checks = sorted((e for e in mine if e["check"] in titles), key=lambda e: order.index(e["check"]))
        caught, first_bad, cases_run = [], "", 0
        for entry in checks:
            cases_run += entry["examples"]
            if entry["failed_at"] is not None:
                caught.append(f"{titles[entry['check']]} (case {entry['failed_at']})")
                first_bad = first_bad or first_location(entry)
        corpus_failed = [e for e in corpus if e["failed_at"] is not None]
        if corpus_failed:
            caught.append(f"corpus ({len(corpus_failed)} of {len(corpus)} cases)")
            first_bad = first_bad or first_location(corpus_failed[0])
        rows.append(
            {
                "backend": backend,
                "caught by": ", ".join(caught) or "nothing",
                "cases run": cases_run + len(corpus),
                "first bad": first_bad or ("-" if not caught else f"(no position: {_first_line(mine)})"),
                "worst ratio": worst_ratio_of(records, backend),
            }
        )
    return pd.DataFrame(rows, columns=COLUMNS)


def detection_problems(table: pd.DataFrame, planted: Collection[str]) -> list[str]:
    """What makes a detection run fail: a planted bug that nothing caught, a correct backend that something
    failed (``planted``: the backends that model bugs; every other row is a correct backend)."""
    problems = []
    for row in table.to_dict("records"):
        backend, caught = row["backend"], row["caught by"]
        if backend in planted and caught == "nothing":
            problems.append(f"planted bug {backend} was not caught ({row['cases run']} cases run)")
        elif backend not in planted and caught != "nothing":
            problems.append(f"correct backend {backend} failed: {caught}")
    return problems


def detection_verdict(table: pd.DataFrame, planted: Collection[str]) -> str:
    """The run's verdict in one line, printed last (it was only in the exit code, after 400 lines)."""
    caught = [row["caught by"] != "nothing" for row in table.to_dict("records") if row["backend"] in planted]
    alarms = [row["caught by"] != "nothing" for row in table.to_dict("records") if row["backend"] not in planted]
    return (
        f"caught {sum(caught)} of {len(caught)} planted bug{'s' if len(caught) != 1 else ''}; "
        f"false alarms on {sum(alarms)} of {len(alarms)} correct backend{'s' if len(alarms) != 1 else ''}"
    )


def detection_markdown(table: pd.DataFrame, descriptions: Mapping[str, str], shown_command: str) -> str:
    table = table.copy()
    table.insert(1, "models", [descriptions.get(name, "") for name in table["backend"]])
    return (
        "# Detection table\n\n"
        f"Produced by `{shown_command}`.\n\n"
        "*caught by*: the tests that flagged the backend, with the drawn case (1-based, in the profile's order) "
        "at which each first failed; for the corpus, how many pinned cases failed. *cases run*: property "
        "examples checked plus corpus cases run. *first bad*: the first point past its limit in the first "
        "failure (`seq S token T head H` for outputs, `seq S head H` for states, `row R token T head H` where "
        "outputs before a change point moved). *worst ratio*: the largest error/limit (max-abs or rel-RMS) of "
        "the backend's records in the run, those of known issues (the ledger's) left out: a correct control's "
        "margin, a planted bug's distance past it.\n\n" + table.to_markdown(index=False) + "\n"
    )
