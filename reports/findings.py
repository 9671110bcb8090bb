"""Verdicts as data: the one finding type every check produces and every consumer reads.

A check (the budget check, a metamorphic property, a serving check) returns findings; pytest's messages,
the CLI's tables, the detection table, the run records and the dashboard all read them, and nothing
parses a message back. A finding says which check, case, backend and tensor it is about, the verdict,
the measured errors and the limits they were held to (with the terms each limit came from), the first
bad point, and the command that reproduces it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from kda_cases.case import Case
from kda_reports.environment import redact

# pass and fail judge a tensor; skip: the backend does not take the case; error: it raised (or crashed, or
# hung); resource: the case did not fit the device's memory even alone, which says nothing of the kernel;
# warn: something reported (garbage past the tokens, not batch-invariant, nondeterministic) that fails only
# where the run asks for it (--kda-strict); known: a failure the ledger of known upstream issues excuses;
# marginal: a failure within MARGIN times its limit that fresh draws of the same case did not confirm (shown,
# never red, never a new finding).
# The backend column of an error that is the suite's own (a case it cannot judge), not any kernel's.
SUITE_BACKEND = "(suite)"
VERDICTS = ("pass", "fail", "skip", "error", "resource", "warn", "known", "marginal")
# What a run counts as the backend's failure.
FAILED = ("fail", "error")
# The verdicts worst first: a group of records (a check's tensors and variants) is as bad as its worst.
WORST_FIRST = ("error", "fail", "warn", "marginal", "known", "resource", "skip", "pass")
# A failure within this many times its limit (every metric that failed) is judged again on fresh draws of the
# same case (new seeds) before it counts: ``MARGIN_REDRAWS`` of them, and it counts where most fail too.
MARGIN = 1.5
MARGIN_REDRAWS = 8
# How bad a failure is, worst first (``Finding.tier``): broken (non-finite, a crash, a wrong shape or dtype,
# memory written that is not the kernel's, a repeat or a prefix that moved past the limit), beyond the
# tolerance the library's own tests assert, beyond the suite's working-precision limits only (within the
# library's tolerance), or beyond them where the library states no tolerance of its own.
BROKEN, BEYOND_LIBRARY, BEYOND_PRECISION, NO_CONTRACT = (
    "broken",
    "beyond the library's tolerance",
    "beyond working precision only",
    "beyond working precision (no library tolerance)",
)
TIERS = (BROKEN, BEYOND_LIBRARY, NO_CONTRACT, BEYOND_PRECISION)
# What the judge starts a wrong dtype's problem with (a hard check, as a wrong shape is).
DTYPE_PROBLEM = "dtype "


@dataclass(frozen=True)
class Errors:
    """How far one tensor is from what it is checked against (the truth, or another run of the backend)."""

    max_abs: float
    rel_rms: float
    max_abs_over_ref_rms: float
    nonfinite: int
    shape_ok: bool
    detail: str = ""
    curve: tuple[float, ...] = ()  # outputs: max error per 64 tokens, in token order


@dataclass(frozen=True)
class Limit:
    """One metric's limit and the terms it came from; ``binding`` names the term that set it."""

    metric: str  # "max_abs" or "rel_rms"
    value: float
    baseline: float
    floor: float
    cap: float
    binding: str  # "baseline", "floor" or "cap"


@dataclass(frozen=True)
class Budget:
    """The two limits of one tensor on one case."""

    tensor: str
    max_abs: Limit
    rel_rms: Limit
    # Where the backend declared a working precision (kernels/protocol.py WorkingPrecision): its label, and the
    # budget the strict baseline (the case's own precision) sets, kept beside the declared one.
    precision: str = ""
    strict: Budget | None = None

    @property
    def limits(self) -> tuple[Limit, Limit]:
        return self.max_abs, self.rel_rms

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Budget:
        strict = data.get("strict")
        return cls(
            data["tensor"],
            Limit(**data["max_abs"]),
            Limit(**data["rel_rms"]),
            data.get("precision", ""),
            None if strict is None else cls.from_dict(strict),
        )


@dataclass(frozen=True)
class Location:
    """Where a check first saw something wrong: a token of a sequence (or of a batch row), a state, a pool
    slot, or a row of the caller's output buffer past the tokens."""

    sequence: int | None = None
    token: int | None = None
    head: int | None = None
    row: int | None = None  # a batch row, where the check compares rows rather than sequences
    slot: int | None = None
    position: int | None = None  # packed row position past the last token
    checkpoint: int | None = None  # the case's n-th checkpoint (the state of ``sequence`` after ``token`` tokens)

    def __str__(self) -> str:
        if self.checkpoint is not None:
            return f"checkpoint {self.checkpoint} (seq {self.sequence} after {self.token} tokens) head {self.head}"
        if self.slot is not None:
            return f"slot {self.slot}"
        if self.position is not None:
            return f"row position {self.position}"
        if self.row is not None:
            return f"row {self.row} token {self.token} head {self.head}"
        if self.token is not None:
            return f"seq {self.sequence} token {self.token} head {self.head}"
        return f"seq {self.sequence} head {self.head}"


# A backend's own text (an exception's message, what it printed) goes into every record, the JUnit file, the
# console and the pages: a 10 MB message is cut to this many characters, saying so.
MAX_TEXT = 2000
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def recorded_text(text: str, cut: bool = True) -> str:
    """``text`` as a record keeps it: credentials redacted by their shape (kda_reports.environment.redact),
    control characters written as ``\\xNN`` (an escape sequence must not reach a terminal), whatever UTF-8
    cannot encode escaped (``writable``), and with ``cut`` no longer than MAX_TEXT characters."""
    if not isinstance(text, str):
        return text
    more = len(text) - MAX_TEXT if cut and len(text) > MAX_TEXT else 0
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", redact(writable(text[:MAX_TEXT] if more else text)))
    return f"{text}... [cut: {more} more characters]" if more else text


def writable(text: str) -> str:
    """``text`` with whatever UTF-8 cannot encode (lone surrogates) written as backslash escapes."""
    if not isinstance(text, str):
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def ratio(value: float, limit: float) -> float:
    """``value / limit``; a zero limit gives 0 for a zero value and infinity otherwise."""
    if limit > 0:
        return value / limit
    return 0.0 if value == 0 else math.inf


def worst_first_rank(verdicts: pd.Series) -> pd.Series:
    """Each verdict's place in WORST_FIRST (unknown ones last): sort by it, and the first row is the worst."""
    return verdicts.map({v: i for i, v in enumerate(WORST_FIRST)}).fillna(len(WORST_FIRST))


def worst_ratios(records: pd.DataFrame) -> pd.Series:
    """Each record's error/limit, the larger of its max-abs and rel-RMS ratios (NaN where none was measured)."""
    numbers = [
        pd.to_numeric(records[c], errors="coerce") if c in records else pd.Series(float("nan"), records.index)
        for c in ("ratio", "rel_rms_ratio")
    ]
    return worst_ratio(*numbers)


def message_kind(reason: str) -> str:
    """What kind of failure a reason is, without its numbers, paths, backend and check: the key that groups
    findings (one abort met by two checks is one finding)."""
    found = re.search(r"(CUDA|HIP) error: ([^\n;(]+)", reason)
    text = found.group(0) if found else reason.splitlines()[0] if reason else ""
    text = re.sub(r"during \S+'s call in check \S+", "during the backend's call", text)
    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", text).strip()[:100]


def worst_ratio(max_abs_ratio: Any, rel_rms_ratio: Any) -> Any:
    """Error over limit, the larger of the two metrics' (1 is the limit). Takes floats or pandas columns
    alike and ignores a missing one (NaN), as a row with one metric measured still has a worst ratio."""
    worst = np.fmax(max_abs_ratio, rel_rms_ratio)
    return float(worst) if np.ndim(worst) == 0 else worst


@dataclass(frozen=True)
class Finding:
    """One check's verdict on one tensor (or on the whole call, for a skip, an error or a finding about
    memory rather than a tensor) of one backend on one case."""

    check: str  # the registered check that produced it
    case: Case
    backend: str
    device: str
    verdict: str  # one of VERDICTS
    tensor: str = ""  # "o", "final_state", "checkpoint_states"; "" for the call as a whole
    subject: str = ""  # what the check compared or inspected, e.g. "o against the whole run", "slot 3"
    errors: Errors | None = None
    budget: Budget | None = None
    problems: tuple[str, ...] = ()  # why it failed, one sentence each; empty on a pass
    first_bad: Location | None = None
    repro: str = ""
    reason: str = ""  # why it was skipped or raised
    seconds: float = 0.0  # the backend call's wall time
    reference_form: str = ""  # exact form of the float64 truth: "loop" or "chunked"
    reference_seconds: float = 0.0
    # What a check observed, beyond pass or fail: "not batch-invariant", "garbage", "right under in-place
    # metadata", ... (the records' `observed` column, the dashboard's table of observations).
    observed: str = ""
    # The ledger entry of known issues that matched this finding (conformance/known_issues.toml): on a
    # `known` finding the issue it reproduces; on a passing one an entry that always fails, which did not
    # reproduce here (the run tells whether it reproduced anywhere: stale_known_issues).
    known_issue: str = ""
    # The rel-RMS limit the backend's library asserts on this tensor in its own tests (NaN where it states
    # none): the maintainers' contract, beside the suite's limits.
    library_tolerance: float = math.nan
    # A failure within MARGIN of its limit, judged again on fresh draws of its case: what they gave ("3 of 8
    # fresh draws failed: seed 11 1.12x, ..."); "" where none was made.
    redraws: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r} is not one of {', '.join(VERDICTS)}")
        # Text from a backend (an exception's message, a file name os.fsdecode made) may hold lone surrogates,
        # which no UTF-8 writer takes, credentials, escape sequences, or megabytes: made safe here, once, for
        # every writer after (recorded_text); the repro line is never cut.
        for name in ("subject", "reason", "observed", "known_issue", "backend", "device", "check", "redraws"):
            object.__setattr__(self, name, recorded_text(getattr(self, name)))
        object.__setattr__(self, "repro", recorded_text(self.repro, cut=False))
        object.__setattr__(self, "problems", tuple(recorded_text(problem) for problem in self.problems))

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    @property
    def failed(self) -> bool:
        """A failure of the backend: a tensor out of bounds, or a call that raised."""
        return self.verdict in FAILED

    @property
    def ratio(self) -> float:
        """max-abs / its limit (NaN where the finding holds no measurement)."""
        if self.errors is None or self.budget is None:
            return math.nan
        return ratio(self.errors.max_abs, self.budget.max_abs.value)

    @property
    def rel_rms_ratio(self) -> float:
        """rel-RMS / its limit (NaN where the finding holds no measurement)."""
        if self.errors is None or self.budget is None:
            return math.nan
        return ratio(self.errors.rel_rms, self.budget.rel_rms.value)

    @property
    def worst(self) -> float:
        return worst_ratio(self.ratio, self.rel_rms_ratio)

    @property
    def within_margin(self) -> bool:
        """A failure past its limits by no more than MARGIN, every metric finite and the tensor whole: one that
        fresh draws of the case must confirm before it counts (Run.checked)."""
        return self.verdict == "fail" and self.tier != BROKEN and 1.0 < self.worst <= MARGIN

    @property
    def library_ratio(self) -> float:
        """rel-RMS over the library's own tolerance (NaN where it states none for this tensor)."""
        if self.errors is None or not self.library_tolerance > 0:
            return math.nan
        return ratio(self.errors.rel_rms, self.library_tolerance)

    @property
    def tier(self) -> str:
        """How bad a failure (or a known one) is, one of TIERS; "" for anything else."""
        if self.verdict not in ("fail", "error", "known"):
            return ""
        errors = self.errors
        hard = errors is None or errors.nonfinite > 0 or not errors.shape_ok or not math.isfinite(errors.max_abs)
        if self.verdict == "error" or hard or any(p.startswith(DTYPE_PROBLEM) for p in self.problems):
            return BROKEN
        if self.check == "determinism":  # the same inputs twice, apart past the limit
            return BROKEN
        library = self.library_ratio
        if math.isnan(library):
            return NO_CONTRACT
        return BEYOND_LIBRARY if library > 1 else BEYOND_PRECISION

    @property
    def strict_worst(self) -> float:
        """The worst error/limit against the strict baseline's limits, where the backend declared a working
        precision (NaN otherwise): what its design costs, apart from its verdict."""
        strict = None if self.budget is None else self.budget.strict
        if self.errors is None or strict is None:
            return math.nan
        return worst_ratio(
            ratio(self.errors.max_abs, strict.max_abs.value), ratio(self.errors.rel_rms, strict.rel_rms.value)
        )

    @property
    def title(self) -> str:
        """``kda-... (label) backend NAME`` and the tensor: how every message starts."""
        head = f"{self.case.id} ({self.case.label}) backend {self.backend}"
        return f"{head} tensor {self.tensor}" if self.tensor else head

    def message(self, repro: bool = True, title: bool = True) -> str:
        """Everything a kernel engineer needs from this finding, on a few lines (``title``: naming the case
        and the backend, which a report of several findings of one case says once)."""
        who = self.title if title else (f"tensor {self.tensor}" if self.tensor else "")
        head = ": ".join(part for part in (self.subject, who) if part)
        if self.verdict in ("skip", "error", "resource") or (self.reason and not self.problems):
            lines = [f"{head}: {self.verdict}: {self.reason}"]
        else:
            lines = [f"{head}: " + ("; ".join(self.problems) or "passed")]
            if self.errors is not None and self.budget is not None:
                for limit in self.budget.limits:
                    value = getattr(self.errors, limit.metric)
                    lines.append(
                        f"  {limit.metric} = {value:.3e}, {ratio(value, limit.value):.3g}x its limit {limit.value:.3e} "
                        f"(baseline {limit.baseline:.3e}, floor {limit.floor:.3e}, cap {limit.cap:.3e})"
                    )
                if self.budget.strict is not None:
                    lines.append(
                        f"  limits of its declared working precision ({self.budget.precision}); against the strict "
                        f"baseline's: {self.strict_worst:.3g}x"
                    )
                if not math.isnan(self.library_ratio):
                    lines.append(
                        f"  the library's own tests allow rel-RMS {self.library_tolerance:.3g}: "
                        f"{self.library_ratio:.3g}x that"
                    )
                if self.tier:
                    lines.append(f"  tier: {self.tier}")
                if self.redraws:
                    lines.append(f"  {self.redraws}")
                within = self.errors.max_abs <= self.budget.max_abs.value
                if within and self.first_bad is not None:  # a failure of the rel-RMS limit alone
                    lines.append(f"  largest error: {self.first_bad} (no point past the max-abs limit)")
                else:
                    lines.append(f"  first bad: {self.first_bad or '-'} (first point past the max-abs limit)")
            elif self.first_bad is not None:
                lines.append(f"  first bad: {self.first_bad}")
        if repro and self.repro:
            lines.append(f"  repro: {self.repro}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form (the run's checks file); :meth:`from_dict` reads it back."""
        data = dataclasses.asdict(self)
        data["case"] = self.case.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        data = dict(data)
        data["case"] = Case.from_dict(data["case"])
        if data.get("errors") is not None:
            data["errors"] = Errors(**{**data["errors"], "curve": tuple(data["errors"]["curve"])})
        if data.get("budget") is not None:
            data["budget"] = Budget.from_dict(data["budget"])
        if data.get("first_bad") is not None:
            data["first_bad"] = Location(**data["first_bad"])
        data["problems"] = tuple(data.get("problems", ()))
        return cls(**data)


def failure_report(
    findings: list[Finding], header: str = "", failing: Callable[[Finding], bool] = lambda f: f.failed
) -> str | None:
    """The message of a check's failing findings (None when none fails): ``header`` (or the first failure's
    case and backend), each failure, and the repro line once where the failures share it."""
    failed = [f for f in findings if failing(f)]
    if not failed:
        return None
    repros = list(dict.fromkeys(f.repro for f in failed if f.repro))
    shared = len(repros) == 1
    lines = [header or failed[0].title]
    for finding in failed:
        lines += ["  " + line for line in finding.message(repro=not shared, title=False).splitlines()]
    if shared:
        lines.append(f"  repro: {repros[0]}")
    return "\n".join(lines)


def finding_kind(finding: Finding) -> str:
    """What went wrong, without the case: a tensor past its limits or not finite, what a check observed, or
    the kind of an error's message."""
    if finding.verdict in ("error", "resource") or not (finding.tensor or finding.observed):
        return message_kind(finding.reason)
    if finding.tensor:
        finite = not any("non-finite" in problem for problem in finding.problems)
        return f"tensor {finding.tensor} {'past its limits' if finite else 'not finite'}"
    return finding.observed


def worst_tier(tiers: Iterable[str]) -> str:
    """The worst of some findings' tiers (TIERS' order), "" where none has one."""
    present = set(tiers)
    return next((tier for tier in TIERS if tier in present), "")


def grouped_failures(findings: Iterable[Finding]) -> list[tuple[str, str]]:
    """The failures and errors of a run as one block per finding (backend, check, verdict, kind), most cases
    first: ``(label, text)``, the label ``FAIL`` or ``ERROR``, the text saying how many cases, the worst
    error/limit, and the whole report of the smallest case (fewest tokens, then heads and head size)."""
    groups: dict[tuple[str, str, str, str], list[Finding]] = {}
    for finding in findings:
        if finding.failed:
            key = (finding.backend, finding.check, finding.verdict, finding_kind(finding))
            groups.setdefault(key, []).append(finding)
    blocks = []
    for (backend, check, verdict, kind), members in sorted(groups.items(), key=lambda item: -len(item[1])):
        cases = len({f.case.id for f in members})
        smallest = min(members, key=lambda f: (f.case.total_tokens, f.case.num_v_heads, f.case.head_k_dim))
        worst = max((f.worst for f in members if not math.isnan(f.worst)), default=float("nan"))
        how_bad = "" if math.isnan(worst) else f", worst {worst:.3g}x its limit"
        if math.isinf(worst):  # "worst infx its limit" said nothing
            how_bad = ", non-finite values"
        tier = worst_tier(f.tier for f in members)
        text = f"{backend}, check {check}: {kind} [{tier}]: {cases} case{'s' if cases != 1 else ''}{how_bad}; "
        text += "the smallest:\n"
        text += "\n".join("  " + line for line in smallest.message().splitlines())
        blocks.append(("ERROR" if verdict == "error" else "FAIL", text))
    return blocks


def stale_known_issues(records: pd.DataFrame) -> pd.DataFrame:
    """Ledger entries that no longer reproduce in a run's records: every record an entry matched passed
    (none is ``known`` nor a failure worse than the entry allows). One row per entry: its id, the backends
    and the distinct cases it matched."""
    columns = ["known_issue", "backends", "cases"]
    if records.empty or "known_issue" not in records:
        return pd.DataFrame(columns=columns)
    matched = records[records["known_issue"].fillna("").astype(str) != ""]
    rows = []
    for issue, part in matched.groupby("known_issue"):
        if not part["verdict"].isin(["known", *FAILED]).any():
            backends = ", ".join(sorted(part["backend"].astype(str).unique()))
            rows.append({"known_issue": issue, "backends": backends, "cases": part["case_id"].nunique()})
    return pd.DataFrame(rows, columns=columns)
