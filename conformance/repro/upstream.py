"""Findings ready for upstream: one row per real finding, from the ledger of known issues and a store's records.

A ledger entry (conformance/known_issues.toml) is a finding the suite already tracks; its status comes from each
matched case's newest run in the store (a later run of other cases says nothing of it): ``open`` while a matched
record still fails there, ``fixed`` when every matched record passed (the entry is to be retired), ``not seen``
when no run matched it. New failures are read the same way. An entry is one cause: it may name several libraries'
copies of one code path, and the ids of earlier entries it took over (their records are its). An entry also claims
the failures recorded before it was written (a run's records hold what the ledger of its day matched; the page
reads them with today's ledger, by the same rule as the judge's: backend, check, tensor, device, case fields, the
run's environment, and the entry's allowed worst). A failure of a backend that no entry matches (not the suite's,
not the machine's) is a ``new`` finding, grouped by cause as far as the records tell it: by kernel family (the code
lineage: FLA's chunk kernels and every copy of them are one), the kind of failure, and, for a failure past the
limits, the case (one case failing alike on four copies, in three checks, is one finding; an error's message names
its cause, so one crash is one finding over every case it met). Each row names the kernels' libraries and versions
as the run recorded them, the tier, its smallest failing case (fewest tokens, its repro line), the worst
error/limit and the worst ratio to the library's own tolerance. ``kda-conformance findings`` writes the table
(docs/findings.md) and, where the backend runs on this machine, a standalone test per finding (findings/<id>.py
with its data) that fails while the kernel is wrong, passes once it is right and skips where its library or device
is missing."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch

from kda_cases.case import Case
from kda_cases.files import atomic_write_text
from kda_conformance.checks import CHECKS, run_check
from kda_conformance.checks import offsets_past_2_31 as offsets
from kda_conformance.checks.gradients import WHOLE_BACKWARD
from kda_conformance.judging.known import KnownIssue
from kda_conformance.repro.standalone_finding import (
    called_measurements,
    filler_of,
    measured_device_type,
    takes_gradients,
    write_standalone_finding,
)
from kda_conformance.running.blame import CONTRACT
from kda_conformance.running.faults import DeviceLost
from kda_conformance.running.run import NOT_LAUNCHED, Run
from kda_kernels import guard, registry
from kda_kernels.guard import BackendFault
from kda_kernels.protocol import Backend
from kda_reports.findings import FAILED, message_kind, worst_ratios, worst_tier

STATUSES = ("open", "new", "fixed", "not seen")
# Not a kernel's finding: the suite's own failures and the machine's.
NOT_A_KERNEL = ("(suite)",)
# A standalone file holds the case's inputs and truth; a larger case is minimized first.
MAX_TEST_TOKENS = 4096


@dataclass(frozen=True)
class Measured:
    """One tensor of a finding's smallest case, as its record holds it."""

    backend: str
    check: str
    tensor: str
    max_abs: float
    rel_rms: float
    max_abs_limit: float
    rel_rms_limit: float
    baseline_max_abs: float
    baseline_rel_rms: float
    floor: float
    cap: float
    binding: str
    rel_rms_binding: str
    library_tolerance: float
    nonfinite: int
    first_bad: str
    precision: str
    subject: str = ""  # what the record measured: the whole call, or a part of a check's (a sequence alone...)
    worst: float = math.nan  # the record's error/limit, the larger of its two metrics' (1 is the limit)


def _measured(rows: pd.DataFrame) -> tuple[Measured, ...]:
    """The judged tensors among ``rows`` (one case's records), one per (backend, check, tensor), worst first; the
    gradients check's whole backward apart from its sequences alone and halves (a standalone file calls the
    whole)."""

    def number(row: pd.Series, name: str) -> float:
        value = pd.to_numeric(pd.Series([row.get(name)]), errors="coerce").iloc[0]
        return float(value) if pd.notna(value) else math.nan

    out = {}
    judged = rows[rows["tensor"].fillna("").astype(str) != ""] if "tensor" in rows else rows.iloc[0:0]
    judged = judged[pd.to_numeric(judged.get("budget", pd.Series(dtype=float)), errors="coerce").notna()]
    for _, row in judged.assign(worst=worst_ratios(judged)).sort_values("worst", ascending=False).iterrows():
        subject = str(row.get("subject") or "") if pd.notna(row.get("subject")) else ""
        key = (str(row["backend"]), str(row["check"]), str(row["tensor"]))
        kept = (*key, subject == WHOLE_BACKWARD)
        if kept in out:
            continue
        out[kept] = Measured(
            *key,
            max_abs=number(row, "max_abs"),
            rel_rms=number(row, "rel_rms"),
            max_abs_limit=number(row, "budget"),
            rel_rms_limit=number(row, "budget_rel_rms"),
            baseline_max_abs=number(row, "budget_baseline"),
            baseline_rel_rms=number(row, "baseline_rel_rms"),
            floor=number(row, "budget_floor"),
            cap=number(row, "budget_cap"),
            binding=str(row.get("budget_binding") or ""),
            rel_rms_binding=str(row.get("budget_rel_rms_binding") or ""),
            library_tolerance=number(row, "library_tolerance"),
            nonfinite=int(number(row, "nonfinite")) if not math.isnan(number(row, "nonfinite")) else 0,
            first_bad=str(row.get("first_bad") or ""),
            precision=str(row.get("precision") or "") if pd.notna(row.get("precision")) else "",
            subject=subject,
            worst=number(row, "worst"),
        )
    return tuple(out.values())


def _same_call(records: pd.DataFrame, small: pd.Series, rows: pd.DataFrame) -> pd.DataFrame:
    """Every record of ``small``'s case in its run on the backends of ``rows``: what a repro holds the call to."""
    same = (records["case_id"] == small["case_id"]) & records["backend"].isin(rows["backend"].unique())
    if "run_id" in records:
        same &= records["run_id"].astype(str) == str(small["run_id"])
    return records[same]


def _environment(row: pd.Series) -> str:
    parts = [f"{row.get('env_device_type', '')} {row.get('env_device_name', '')}".strip()]
    parts += [f"{name} {row.get(f'env_{name}')}" for name in ("torch", "triton") if pd.notna(row.get(f"env_{name}"))]
    library = row.get("library")
    parts += [str(library)] if isinstance(library, str) and library else []
    return ", ".join(p for p in parts if p and p != "nan")


@dataclass(frozen=True)
class UpstreamFinding:
    id: str
    backends: str
    kernel: str  # the library and version the run recorded
    status: str  # one of STATUSES
    run: str  # the run the status comes from
    check: str
    cases: int  # distinct failing cases in that run (matched cases when fixed)
    worst: str  # worst error/limit, or the error's message
    first_bad: str
    case_id: str  # the smallest failing case
    case_json: str
    repro: str
    description: str
    confirmed: str = ""
    upstream: str = ""
    test: str = ""  # the standalone test's path, or why there is none
    tier: str = ""  # the worst tier of its failing records (kda_reports.findings TIERS)
    library: str = ""  # the worst ratio to the library's own tolerance ("0.4x FLA's tolerance"), where stated
    case_ids: tuple[str, ...] = ()  # every failing case, smallest first
    copies: tuple[str, ...] = ()  # a ledger entry's copies: "library: where (backends)"
    links: tuple[str, ...] = ()  # a ledger entry's upstream links: "kind ref: status (url)"
    family: str = ""  # the kernel family of a new finding
    # The smallest failing case's judged tensors as the run recorded them (on its backend and device): per
    # tensor the measured errors, the limits and the terms behind them, the library's tolerance.
    measured: tuple[Measured, ...] = ()
    environment: str = ""  # where that record was made: device, torch, triton, the library's version
    title: str = ""  # an upstream issue's title
    cause: str = ""  # a new finding's cause as `kda-conformance triage` found it ("not triaged" where it did not)
    sanitizer: str = ""  # what compute-sanitizer reported on its smallest case (`kda-conformance sanitize`)
    device: str = ""  # a ledger entry's device ("cuda", "cpu"; "" any)


def _kernel(rows: pd.DataFrame) -> str:
    """The library and version behind the rows' backends, as each backend declares it (the records' ``library``
    column); the backends' names where a run recorded none (an older store, a plugin that declares none)."""
    libraries = sorted({str(v) for v in rows.get("library", pd.Series(dtype=str)).dropna() if str(v)})
    backends = ", ".join(sorted(set(rows["backend"].astype(str))))
    return "; ".join(libraries) or f"{backends} (library not recorded)"


def _worst(rows: pd.DataFrame) -> str:
    """The worst error/limit, max-abs or rel-RMS, over the rows; and the first error's message."""
    ratios = pd.concat(
        [pd.to_numeric(rows[c], errors="coerce") for c in ("ratio", "rel_rms_ratio") if c in rows]
    ).dropna()
    worst = ""
    if not ratios.empty:
        top = float(ratios.max())
        worst = "non-finite values" if top == float("inf") else f"{top:.3g}x the limit"
    errors = rows[rows["verdict"] == "error"]
    if not errors.empty:
        message = message_kind(str(errors.iloc[0]["reason"]))
        worst = f"{worst}; error: {message}" if worst else f"error: {message}"
    return worst or "-"


def _quarantined(rows: pd.DataFrame) -> pd.Series:
    """The records of cases a quarantine kept from launching after another case crashed their kernel
    configuration: the crash's consequence, recorded with its own case, not a finding of their own."""
    observed = rows.get("observed", pd.Series("", index=rows.index)).fillna("").astype(str)
    return observed == NOT_LAUNCHED


def _smallest(rows: pd.DataFrame) -> pd.Series:
    """The record of the fewest tokens; among those, one of a backend a standalone file can call (AITER's and
    FLA's kernels failing one case alike: FLA's record, so the file for upstream has measurements to show)."""
    tokens = pd.to_numeric(rows.get("case_total_tokens"), errors="coerce").fillna(float("inf"))
    backends = rows["backend"].astype(str)
    uncallable = backends.map({name: not _callable_alone(name) for name in backends.unique()})
    order = pd.DataFrame({"tokens": tokens, "uncallable": uncallable}).sort_values(
        ["tokens", "uncallable"], kind="stable"
    )
    return rows.loc[order.index[0]]


def _callable_alone(backend: str) -> bool:
    try:
        return registry.get(backend).standalone_source is not None
    except (KeyError, registry.PluginError):
        return False


def _newest(rows: pd.DataFrame) -> str:
    """The newest run among ``rows``: by the time it started (``env_date``), then its id. A night's id is
    the user's (``night-e``, ``servers-n20b``), so its text says nothing of when it ran."""
    runs = rows.assign(run_id=rows["run_id"].astype(str))
    started = runs["env_date"].fillna("").astype(str) if "env_date" in runs else pd.Series("", index=runs.index)
    order = runs.assign(started=started).sort_values(["started", "run_id"])
    return str(order["run_id"].iloc[-1])


def _claimed(records: pd.DataFrame, ledger: tuple[KnownIssue, ...]) -> pd.Series:
    """The ledger entry each record is known by: the one its run matched, or for a failure its run's ledger
    did not know, the first of today's entries that matches and allows it (KnownIssue.matches, on the
    record's fields and its run's recorded environment instead of this process's); for an error, the first
    that matches and names words of its message (``raises``, or ``crashes``: a crash stays an error in its run,
    but has its cause here)."""
    matched = records["known_issue"].fillna("").astype(str) if "known_issue" in records else None
    if matched is None:
        return pd.Series("", index=records.index, dtype=str)
    taken_over = {old: issue.id for issue in ledger for old in issue.replaces}
    matched = matched.map(lambda known: taken_over.get(known, known))
    worsts = worst_ratios(records)
    unclaimed = records[records["verdict"].isin(["fail", "error"]) & (matched == "")]
    for index, row in unclaimed.iterrows():
        if row["verdict"] == "error":  # an error is an entry's where the entry names words of its message
            reason = "" if pd.isna(row.get("reason")) else str(row.get("reason"))
            claims = [i for i in ledger if (i.names_error(reason) or i.names_crash(reason)) and _claims(i, row)]
            if claims:
                matched.at[index] = claims[0].id
            continue
        worst = float(worsts[index])
        for issue in ledger:
            if _claims(issue, row) and (worst <= issue.allowed or (math.isnan(worst) and math.isinf(issue.allowed))):
                matched.at[index] = issue.id
                break
    # An observation without a ratio (a replay that differs from its eager call) is the cause of the error
    # measured beside it, on the same call of the same check: the entry that claims that error claims it
    # (judging/known.py apply_known, for the runs recorded before it did so).
    call = [c for c in ("run_id", "case_id", "backend", "check") if c in records]
    by_id = {issue.id: issue for issue in ledger}
    for index, row in records[records["verdict"].eq("fail") & (matched == "") & worsts.isna()].iterrows():
        same = (records[call] == row[call]).all(axis=1) & (matched != "")
        beside = [by_id[known] for known in matched[same] if known in by_id and _claims(by_id[known], row)]
        if beside:
            matched.at[index] = beside[0].id
    return matched


def _claims(issue: KnownIssue, row: pd.Series) -> bool:
    text = lambda name: "" if pd.isna(row.get(name)) else str(row.get(name))  # noqa: E731
    if text("backend") not in issue.backends or (issue.checks and text("check") not in issue.checks):
        return False
    if (issue.tensors and text("tensor") not in issue.tensors) or (
        issue.observed and text("observed") not in issue.observed
    ):
        return False
    if issue.device and text("device").split(":")[0] != issue.device:
        return False
    try:
        case = Case.from_json(text("case_json"))
        variables = json.loads(text("env_variables") or "{}")
    except (ValueError, TypeError):
        return False
    if any(getattr(case, name, None) not in values for name, values in issue.when.items()):
        return False
    return all(str(variables.get(name, "")) in values for name, values in issue.environment.items())


def _tier(rows: pd.DataFrame) -> str:
    """The worst tier of failing records (their ``tier`` column; an older store's error or non-finite record is
    broken by definition, and its other failures untiered)."""
    recorded = rows["tier"].fillna("").astype(str) if "tier" in rows else pd.Series("", index=rows.index)
    nonfinite = pd.to_numeric(rows.get("nonfinite", pd.Series(0, index=rows.index)), errors="coerce").fillna(0)
    broken = (rows["verdict"] == "error") | (nonfinite > 0)
    return worst_tier([*recorded, *(["broken"] * int(broken.sum()))])


def _library(rows: pd.DataFrame) -> str:
    ratios = pd.to_numeric(rows.get("library_ratio", pd.Series(dtype=float)), errors="coerce").dropna()
    return "" if ratios.empty else f"{float(ratios.max()):.3g}x"


def _row(
    id_: str, rows: pd.DataFrame, status: str, run: str, records: pd.DataFrame | None = None, **text: object
) -> UpstreamFinding:
    """The finding of ``rows`` (its records in ``run``); ``records``: every record of the store, whose other
    tensors of the smallest case (the ones that passed) are measured beside the failing ones."""
    failing = rows[rows["verdict"].isin(["known", *FAILED])]
    shown = failing if not failing.empty else rows
    small = _smallest(shown)
    tokens = pd.to_numeric(shown.get("case_total_tokens"), errors="coerce").fillna(float("inf"))
    case_ids = tuple(dict.fromkeys(shown.loc[tokens.sort_values(kind="stable").index, "case_id"].astype(str)))
    return UpstreamFinding(
        id=id_,
        backends=", ".join(sorted(rows["backend"].astype(str).unique())),
        kernel=_kernel(rows),
        status=status,
        run=run,
        check=", ".join(sorted(shown["check"].astype(str).unique())),
        cases=int(shown["case_id"].nunique()),
        worst=_worst(failing) if not failing.empty else "passes",
        first_bad=str(small.get("first_bad") or "-") if not failing.empty else "-",
        case_id=str(small["case_id"]),
        case_json=str(small.get("case_json", "")),
        repro=str(small.get("repro", "")),
        tier=_tier(failing),
        library=_library(failing),
        case_ids=case_ids,
        measured=_measured(_same_call(rows if records is None else records, small, rows)),
        environment=_environment(small),
        **text,
    )


def for_other_devices(findings: list[UpstreamFinding], records: pd.DataFrame) -> list[UpstreamFinding]:
    """The ledger entries no run of the store could have seen: `not seen`, for a device no record was made on
    (a CPU store and the GPU entries). Listed, they read as 18 entries "not seen"; they are counted instead."""
    seen = set(records["device"].astype(str).str.split(":").str[0]) if "device" in records else set()
    return [f for f in findings if f.status == "not seen" and f.device and f.device not in seen]


def upstream_findings(records: pd.DataFrame, ledger: tuple[KnownIssue, ...]) -> list[UpstreamFinding]:
    """One row per ledger entry (its status in each matched case's newest run) and per new kernel failure (as
    each case's newest run has it)."""
    rows = []
    matched = _claimed(records, ledger) if "known_issue" in records else pd.Series()
    for issue in ledger:
        text: dict[str, object] = {
            "description": issue.description,
            "confirmed": issue.confirmed,
            "upstream": issue.upstream,
            "copies": tuple(f"{c.library}: {c.where} ({', '.join(c.backends)})" for c in issue.copies),
            "links": tuple(link.text() + (f" ({link.url})" if link.url else "") for link in issue.links),
        }
        mine = records[matched == issue.id] if not matched.empty else records.iloc[0:0]
        if mine.empty:
            backends, checks = ", ".join(issue.backends), ", ".join(issue.checks)
            unseen = dict(status="not seen", run="", check=checks, cases=0, worst="-", first_bad="-", case_id="")
            rows.append(
                UpstreamFinding(issue.id, backends, "", **unseen, case_json="", repro="", device=issue.device, **text)
            )
            continue
        last = _newest_per_case(mine)
        run = _newest(last)
        status = "open" if last["verdict"].isin(["known", *FAILED]).any() else "fixed"
        rows.append(_row(issue.id, last, status, run, records, title=issue.description.split(". ")[0], **text))
    fresh = records[
        records["verdict"].isin(FAILED)
        & (matched == "" if not matched.empty else True)
        & ~records["backend"].astype(str).isin(NOT_A_KERNEL)
        & ~_quarantined(records)
    ]
    if fresh.empty:
        return rows
    fresh = fresh[fresh.index.isin(_newest_per_case(records).index)]
    rows.extend(_new_findings(fresh, {row.id for row in rows}, records))
    return rows


def _newest_per_case(rows: pd.DataFrame) -> pd.DataFrame:
    """The records of each (backend, case) in the newest run that has them: a later run of other cases (a
    repro, a rerun of one family) says nothing of this case; taking each backend's newest run dropped the
    failures of its earlier runs from the page."""
    started = rows["env_date"].fillna("").astype(str) if "env_date" in rows else ""
    order = rows.assign(_started=started, _run=rows["run_id"].astype(str)).sort_values(["_started", "_run"])
    newest = order.groupby(["backend", "case_id"])["_run"].transform("last")
    return rows.loc[order.index[(order["_run"] == newest).to_numpy()]]


def family_of(backend: str) -> str:
    """The kernel family a backend declares (``Backend.family``), else its own name (the suite's backends, a
    plugin not loaded here)."""
    try:
        return registry.get(backend).family or backend
    except (KeyError, registry.PluginError):
        return backend


def failure_kind(rows: pd.DataFrame) -> pd.Series:
    """What went wrong in each failing record, without its numbers: an error's message kind, ``not finite``,
    what a check observed (``causal leak``, ``wrong under in-place metadata``), or ``past the limit``."""
    errors = rows["verdict"] == "error"
    nonfinite = pd.to_numeric(rows.get("nonfinite", pd.Series(0, index=rows.index)), errors="coerce").fillna(0) > 0
    observed = rows.get("observed", pd.Series("", index=rows.index)).fillna("").astype(str)
    kinds = rows["reason"].fillna("").astype(str).map(message_kind)
    # A write into an input or outside its outputs is no error past a limit (it has no numbers at all).
    subject = rows.get("subject", pd.Series("", index=rows.index)).fillna("").astype(str)
    contract = subject.str.startswith(CONTRACT)
    limit = observed.where(observed != "", "past the limit").where(~nonfinite, "not finite")
    return kinds.where(errors, limit.where(~contract, "broke the call contract"))


def _new_findings(fresh: pd.DataFrame, taken: set[str], records: pd.DataFrame) -> list[UpstreamFinding]:
    """The failures no ledger entry claims, one finding per cause as far as the records tell it: per kernel
    family and kind of failure, and, for a failure past the limits (whose message does not name its cause),
    per case. Each lists its cases, backends and checks."""
    kinds = failure_kind(fresh)
    errors = fresh["verdict"] == "error"
    family = fresh["backend"].astype(str).map(family_of)
    # An error's message names its cause, so it is one finding over every case it met; a number past a limit
    # is one per case.
    case = fresh["case_id"].astype(str).where(~errors, "")
    grouped = fresh.assign(family=family, kind=kinds, group_case=case, raised=errors)
    found = []
    for (family_name, kind, case_id), part in grouped.groupby(["family", "kind", "group_case"], sort=True):
        slug = re.sub(r"[^a-z0-9]+", "-", f"{family_name} {kind}".lower()).strip("-")[:60].strip("-")
        id_ = f"new-{slug}" + (f"-{case_id}" if case_id else "")
        base, n = id_, 2
        while id_ in taken:  # two kinds that share the truncated text: ids stay unique (anchors, file names)
            id_, n = f"{base}-{n}", n + 1
        taken.add(id_)
        checks = ", ".join(sorted(part["check"].astype(str).unique()))
        backends = ", ".join(sorted(part["backend"].astype(str).unique()))
        what = f"raised {kind}" if part["raised"].iloc[0] else kind
        where = "every case it met" if not case_id else f"case {case_id}"
        text = f"not in the ledger: {family_name}, {what}, {where}; backends {backends}; checks {checks}"
        label = str(part["label"].iloc[0]) if "label" in part and case_id else f"{part['case_id'].nunique()} cases"
        title = f"{family_name}: {what} ({backends}; {label})"
        found.append(
            _row(id_, part, "new", _newest(part), records, description=text, family=str(family_name), title=title)
        )
    return found


def write_finding_test(
    finding: UpstreamFinding, device: torch.device, folder: Path, run: Run | None = None
) -> UpstreamFinding:
    """Write ``folder/test_<id>_<library>.py`` for a finding, one for each library whose backend measured it
    (conformance/repro/standalone_finding.py: torch, the kernel's package and pytest, nothing of this suite),
    run each once where its backend runs here to say whether it fails today, and return the finding with
    ``test`` saying where each is or why there is none. Where one runs, the finding's check is then rerun on
    its case and backend through ``run``'s executor (the sweep's rules: journal, quarantine, memory retry,
    ledger), which says whether the suite itself still sees it here."""
    if finding.status not in ("open", "new") or not finding.case_json:
        return replace(finding, test="-")
    case = Case.from_json(finding.case_json)
    if case.total_tokens > MAX_TEST_TOKENS:
        return replace(
            finding, test=f"not written: {case.total_tokens} tokens (more than {MAX_TEST_TOKENS}); minimize it first"
        )
    names = finding.backends.split(", ")
    registered = [registry.get(name) for name in names if name in registry.names()]
    if not registered:
        return replace(finding, test=f"not written: backend {names[0]} is not registered here")
    callable_ = [b for b in registered if b.standalone_source is not None]
    if not callable_:
        shown = ", ".join(b.name for b in registered)
        return replace(finding, test=f"not written: {shown} give no standalone call; it reruns with its repro line")
    chosen = _one_per_library([b for b in callable_ if called_measurements(finding, b)])
    if not chosen and finding.tier == "broken":  # a crash: the file holds the call to running at all
        chosen = callable_[:1]
    if not chosen:
        return replace(
            finding,
            test=f"not written: the budget check judged no output or final state of its smallest case, nor the "
            f"gradients check a whole backward; the {finding.check} check's finding reruns with its repro line",
        )
    said: list[str] = []
    for backend in chosen:
        name = finding_file_name(finding.id, library_slug(backend))
        try:
            said.append(_write_and_run(finding, case, backend, device, folder, name, run))
        except FindingLostDevice as lost:
            raise FindingLostDevice(replace(finding, test="; ".join([*said, lost.finding.test])), lost) from None
    return replace(finding, test="; ".join(said))


def library_slug(backend: Backend) -> str:
    """The library a backend's kernel comes from, as a file name's part (``vllm``, ``sglang``, ``aiter``)."""
    library = backend.libraries[0] if backend.libraries else None
    return re.sub(r"\W+", "_", (library.module or library.name).lower()) if library else "suite"


def finding_file_name(finding_id: str, library: str) -> str:
    """``test_<id>_<library>.py``: one cause lives in several libraries' copies of a code path (the ledger's
    copies), and each library's maintainers get a file that calls their own kernel."""
    return f"test_{finding_id.replace('-', '_')}_{library}.py"


def committed_test_files(finding_id: str, folder: Path) -> list[Path]:
    """The finding's files in ``folder``, one per library (:func:`finding_file_name`)."""
    libraries = {library_slug(registry.get(name)) for name in registry.names()}
    return sorted(p for lib in libraries if (p := folder / finding_file_name(finding_id, lib)).exists())


def _one_per_library(backends: list[Backend]) -> list[Backend]:
    first: dict[str, Backend] = {}
    for backend in backends:
        first.setdefault(library_slug(backend), backend)
    return list(first.values())


def _write_and_run(
    finding: UpstreamFinding, case: Case, backend: Backend, device: torch.device, folder: Path, name: str,
    run: Run | None,
) -> str:  # fmt: skip
    """One library's file for the finding, written, run once here, and the suite's own rerun of the case on
    ``backend`` after it: what the test column says of it."""
    measured = called_measurements(finding, backend)
    within = all(m.max_abs <= m.max_abs_limit and m.rel_rms <= m.rel_rms_limit for m in measured)
    if takes_gradients(measured) and within:
        return (
            "not written: its whole backward was within every limit; what failed (a sequence alone, a resumed "
            "half, a repeat or poisoned scratch) reruns with its repro line"
        )
    measured_on = measured_device_type(finding)
    if measured_on == "cpu" and backend.interpreted(torch.device("cpu")):
        return (
            "not written: measured in Triton's CPU interpreter with the suite's workarounds, which a standalone "
            "file does not carry; rerun on a GPU"
        )
    # The file first, run in a process of its own (a crash there costs this process nothing); the suite's
    # own rerun last, since a sticky device error in it ends what this process may run.
    path = write_standalone_finding(finding, case, backend, folder, name)
    if measured_on != device.type:  # a GPU's finding written on a CPU: the file skips here
        where = finding.environment or measured_on
        return f"{path.name} (written; not run on {device}: it was measured on {where})"
    try:
        support = guard.availability(backend, device)
        support = guard.supports(backend, case) if support else support
    except BackendFault as fault:
        return f"{path.name} (written; {backend.name} faulted here: {fault})"
    if not support:
        return f"{path.name} (written; not run on {device}: {support.reason})"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", str(path.resolve())],
        capture_output=True,
        text=True,
        cwd=path.parent,
    )
    state = {0: "PASSES today (not a repro)", 1: "fails today"}.get(done.returncode, f"exit {done.returncode}")
    if done.returncode == 0 and " skipped" in done.stdout:
        state = "skips here"
    try:
        check = "gradients" if takes_gradients(measured) else (offsets.NAME if filler_of(finding, case) else "budget")
        rerun = run_check(CHECKS[check], case, backend, device, run=run)
    except DeviceLost as lost:
        if run is not None:
            run.record(lost.findings)
        said = f"{path.name} ({state} on {device}; the suite's rerun lost the device here: {lost})"
        raise FindingLostDevice(replace(finding, test=said), lost) from None
    if run is not None:
        run.record(rerun)
    seen = "fails" if any(f.failed or f.verdict == "known" for f in rerun) else "passes"
    return f"{path.name} ({state} on {device}; the suite's {check} check {seen} here)"


class FindingLostDevice(DeviceLost):
    """A finding's file was written and run, and then the suite's own rerun of it left a sticky device error:
    nothing more may run on the device in this process. ``finding`` says so in its test column."""

    def __init__(self, finding: UpstreamFinding, lost: DeviceLost) -> None:
        super().__init__(lost.findings, str(lost))
        self.finding = finding


def findings_markdown(
    findings: list[UpstreamFinding], source: str, precisions: list[str] | None = None, elsewhere: str = ""
) -> str:
    """docs/findings.md: the table, then the cost of the designs the libraries declare (``precisions``: lines of
    reports/precision.py), then each finding's text, copies, upstream links, cases and repro line; ``elsewhere``:
    what is said of the ledger entries of devices the store never ran on, not listed."""
    counts = ", ".join(f"{sum(f.status == s for f in findings)} {s}" for s in STATUSES)
    counts += f"; {elsewhere}" if elsewhere else ""
    lines = [
        "# Findings ready for upstream",
        "",
        f"Generated by `kda-conformance findings` from {source} and conformance/known_issues.toml ({counts}).",
        "A ledger entry is one cause, in every library's copy of its code; it is `open` while a case it matched",
        "still fails in that case's newest run, `fixed` when every case it matched passed there (retire it),",
        "`not seen` when no run in the store matched it; `new` is a kernel's failure no entry matches, grouped",
        "by kernel family, kind of failure and (past the limits) case. Worst is error/limit over the failing records",
        "of that run; *library* their worst rel-RMS over the tolerance the library's own tests assert; *tier*:",
        "broken, beyond the library's tolerance, or beyond the suite's working-precision limits only. Failures",
        "within 1.5 times a limit that fresh draws did not confirm are `marginal` and never listed.",
        (
            "Each test is findings/test_<id>_<library>.py (one per library whose kernel measured it), written by "
            "`--write-tests DIR` on a machine where the backend runs and run once there; it needs torch, the "
            "kernel's library and pytest, and skips where they or the GPU are missing."
            if any(f.test not in ("", "-") for f in findings)
            else "No standalone test was written in this generation: `--write-tests DIR`, on a machine where the "
            "backends run, writes and runs them."
        ),
        "",
        "A new finding's *cause* is what `kda-conformance triage` found: the one switch under which its smallest "
        "case passes, `not established` where none did, `not triaged` where it did not run (a ledger entry's "
        "cause is its text).",
        "",
        "| finding | status | tier | kernel | backends | check | cases | worst | library | first bad | smallest case "
        "| cause | test |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in findings:
        cells = [f"[{f.id}](#{f.id})", f.status, f.tier or "-", f.kernel or "-", f.backends, f.check or "-",
                 str(f.cases), f.worst, f.library or "-", f.first_bad, f.case_id or "-", f.cause or "-",
                 f.test or "-"]  # fmt: skip
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    if precisions:
        lines += [
            "",
            "## Cost of design",
            "",
            "Declared working precisions: a design the kernel's library states in its code or documents, judged "
            "against the baseline at that precision; not findings. What each costs against the strict limits (what "
            "a user passing each input dtype gets):",
            "",
            *(f"- {line}" for line in precisions),
        ]
    for f in findings:
        lines += ["", f"## {f.id}", "", f"{f.status}, in run {f.run or '-'}: {f.description}"]
        if f.tier:
            lines.append(
                f"\nTier: {f.tier}" + (f"; the library's own tolerance: {f.library} at worst" if f.library else "")
            )
        if f.copies:
            lines += ["", "Copies of the code path:", "", *(f"- {c}" for c in f.copies)]
        if f.cause:
            lines.append(f"\nCause (triage): {f.cause}")
        if f.sanitizer:
            lines.append(f"\nSanitizer: {f.sanitizer}")
        if f.confirmed:
            lines.append(f"\nConfirmed: {f.confirmed}")
        if f.upstream:
            lines.append(f"\nWhere: {f.upstream}")
        if f.links:
            lines += ["", "Upstream:", "", *(f"- {link}" for link in f.links)]
        if len(f.case_ids) > 1:
            shown = ", ".join(f.case_ids[:12]) + (f" and {len(f.case_ids) - 12} more" if len(f.case_ids) > 12 else "")
            lines.append(f"\nCases ({len(f.case_ids)}, smallest first): {shown}")
        if f.repro:
            lines += ["", "Smallest failing case, rerun with:", "", f"    {f.repro}"]
    return "\n".join(lines) + "\n"


def write_findings_page(
    findings: list[UpstreamFinding], source: str, path: Path, precisions: list[str] | None = None, elsewhere: str = ""
) -> Path:
    atomic_write_text(Path(path), findings_markdown(findings, source, precisions, elsewhere))
    return Path(path)
