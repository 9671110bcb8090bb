"""The ledger of known upstream problems (``conformance/known_issues.toml``), applied to findings.

An entry matches an issue: a backend on a family of cases (case fields, device, environment, the check and
what it observed), and the tensors it lists (all, by default). Applied to the findings of one check on one
case, a failed finding that matches an entry becomes ``known`` while its worst error/limit stays within the
entry's ``worst`` x ``growth``, and stays a failure (saying so) beyond it; an observation with no ratio to bound
(a causal leak, a graph replay that differs from its eager call) is ``known`` only under an entry whose ``worst``
is inf, or one that allows the error measured beside it in the same findings, and an entry of crashes alone
(``worst = 0``: a launch that fails) claims no failure with numbers; a backend's error is ``known``
where an entry names words of its message (``raises``; a crash an entry names, ``crashes``, stays an
error: the findings page lists it under the entry); a finding of the same case that
passes stays a pass (an issue of the output need not spoil the state). Every finding an entry matched
carries the entry's id (``known_issue``), so a run can tell, over all its cases, an entry that no longer
reproduces (``kda_reports.findings.stale_known_issues``): a warning, and a failure under --kda-strict.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kda_reports.findings import SUITE_BACKEND, Finding

LEDGER = Path(__file__).resolve().parent.parent / "known_issues.toml"
# The ledger a run applies, where not this one: another file, or none at all where the variable is set empty
# (triage's reruns ask whether a case fails, and a known failure exits 0 as a pass does).
LEDGER_VARIABLE = "KDA_LEDGER"
LINK_KINDS = ("issue", "pr", "commit", "none")


@dataclass(frozen=True)
class UpstreamLink:
    """Where a problem is tracked upstream: an issue, a PR, a fixing commit (``owner/repo#N``,
    ``owner/repo@sha``), or ``none`` (not reported, and why), with its status there."""

    kind: str
    ref: str
    status: str

    def __post_init__(self) -> None:
        if self.kind not in LINK_KINDS:
            raise ValueError(f"link kind {self.kind!r} not allowed; choose from {', '.join(LINK_KINDS)}")
        if not self.ref.strip() or not self.status.strip():
            raise ValueError("a link names its ref and its status upstream")

    def text(self, ref: str | None = None) -> str:
        """One line for a page or a report: a ``none`` link is its status alone (which says it is not
        reported and why), any other its kind, its ref (or ``ref`` as given, a link of a page) and status."""
        if self.kind == "none":
            return self.status
        return f"{self.kind} {self.ref if ref is None else ref}: {self.status}"

    @property
    def url(self) -> str:
        """The GitHub address of an issue, PR or commit ("" for ``none``)."""
        if self.kind == "none":
            return ""
        if "#" in self.ref:
            repo, number = self.ref.split("#", 1)
            return f"https://github.com/{repo}/{'pull' if self.kind == 'pr' else 'issues'}/{number}"
        if "@" in self.ref:
            repo, commit = self.ref.split("@", 1)
            return f"https://github.com/{repo}/commit/{commit}"
        return ""


@dataclass(frozen=True)
class Copy:
    """One library's copy of the code path a cause lives in: where it is, and the backends that run it."""

    library: str
    where: str
    backends: tuple[str, ...]


@dataclass(frozen=True)
class KnownIssue:
    id: str
    backends: tuple[str, ...]
    description: str
    upstream: str
    added: str
    worst: float
    growth: float = 1.5
    always_fails: bool = True
    checks: tuple[str, ...] = ()
    device: str = ""
    when: dict[str, tuple] = field(default_factory=dict)
    environment: dict[str, tuple[str, ...]] = field(default_factory=dict)
    observed: tuple[str, ...] = ()  # what the check observed (the finding's `observed`), where that matters
    tensors: tuple[str, ...] = ()  # the tensors it lets fail (default: every tensor)
    confirmed: str = ""  # how the cause was confirmed (a rerun that makes it go away, say)
    # Errors it is: the backend's own exception, by words of its message (FLA's FlashKDA dispatch raising
    # "all tensors must be contiguous" on strided inputs). An error no entry names stays an error.
    raises: tuple[str, ...] = ()
    # Crashes it causes, by words of the record's message: an error that kills the device (a misaligned
    # address) or the process (an abort). Such an error stays an error in its run (the device or the worker is
    # lost and its configuration quarantined, whoever is to blame, and the run exits 3), but the findings page
    # lists it under this entry, one finding per cause, instead of as new every night.
    crashes: tuple[str, ...] = ()
    links: tuple[UpstreamLink, ...] = ()  # where it is tracked upstream, with the status there
    copies: tuple[Copy, ...] = ()  # one cause in several libraries' copies of one code path
    replaces: tuple[str, ...] = ()  # earlier entries' ids it took over: records that name them are its

    @property
    def allowed(self) -> float:
        """The worst error/limit a matching failure may reach and still be this issue."""
        return self.worst * self.growth

    def names_error(self, reason: str) -> bool:
        """Whether this entry names an error by words of its message (``raises``)."""
        return any(words in reason for words in self.raises)

    def names_crash(self, reason: str) -> bool:
        """Whether this entry names a crash by words of its record's message (``crashes``)."""
        return any(words in reason for words in self.crashes)

    def matches(self, finding: Finding) -> bool:
        if finding.backend not in self.backends or (self.checks and finding.check not in self.checks):
            return False
        if self.tensors and finding.tensor not in self.tensors:
            return False
        if self.device and finding.device.split(":")[0] != self.device:
            return False
        if self.observed and finding.observed not in self.observed:
            return False
        if any(getattr(finding.case, name) not in values for name, values in self.when.items()):
            return False
        return all(os.environ.get(name, "") in values for name, values in self.environment.items())


def load_ledger(path: Path = LEDGER) -> tuple[KnownIssue, ...]:
    """The ledger's entries; an entry with an unknown or missing field is an error that names it."""
    data = tomllib.loads(Path(path).read_text())
    issues = []
    for number, entry in enumerate(data.get("issue", []), 1):
        try:
            issue = KnownIssue(
                **{
                    **entry,
                    "links": tuple(UpstreamLink(**link) for link in entry.get("links", ())),
                    "copies": tuple(
                        Copy(**{**copy, "backends": tuple(copy["backends"])}) for copy in entry.get("copies", ())
                    ),
                    "replaces": tuple(entry.get("replaces", ())),
                    "backends": tuple(entry["backends"]),
                    "checks": tuple(entry.get("checks", ())),
                    "observed": tuple(entry.get("observed", ())),
                    "tensors": tuple(entry.get("tensors", ())),
                    "raises": tuple(entry.get("raises", ())),
                    "crashes": tuple(entry.get("crashes", ())),
                    "when": {k: tuple(v) for k, v in entry.get("when", {}).items()},
                    "environment": {k: tuple(v) for k, v in entry.get("environment", {}).items()},
                }
            )
        except (TypeError, KeyError, ValueError) as exc:
            raise ValueError(
                f"{Path(path).name}: issue {number} ({entry.get('id', '?')}) is not valid: {exc}"
            ) from None
        if not issue.confirmed:
            raise ValueError(f"{Path(path).name}: issue {number} ({issue.id}) does not say how it was confirmed")
        if not issue.links:
            raise ValueError(
                f"{Path(path).name}: issue {number} ({issue.id}) says nothing of where it is tracked upstream: add an "
                '[[issue.links]] (kind "issue", "pr", "commit", or "none" with why)'
            )
        strays = [b for copy in issue.copies for b in copy.backends if b not in issue.backends]
        if strays:
            raise ValueError(f"{Path(path).name}: issue {number} ({issue.id}): copies name backends {strays} it lacks")
        issues.append(issue)
    return tuple(issues)


def ledger_problem() -> str | None:
    """What is wrong with the ledger ``KDA_LEDGER`` names (a run checks it before its first case), else None."""
    chosen = os.environ.get(LEDGER_VARIABLE)
    if not chosen:
        return None
    try:
        _ledger_at(Path(chosen))
    except OSError as exc:
        return f"{chosen}: {exc.strerror or exc} (the ledger a run applies; set it empty to apply none)"
    except (ValueError, TypeError, KeyError) as exc:
        return f"{chosen}: {exc}"
    return None


def ledger() -> tuple[KnownIssue, ...]:
    """The entries a run applies: the suite's ledger, or the file ``KDA_LEDGER`` names (none where it is empty).
    Every check's findings pass through it: each file is read once a process."""
    chosen = os.environ.get(LEDGER_VARIABLE)
    if chosen == "":
        return ()
    return _ledger_at(LEDGER if chosen is None else Path(chosen))


@functools.cache
def _ledger_at(path: Path) -> tuple[KnownIssue, ...]:
    return load_ledger(path)


def apply_known(findings: Iterable[Finding], issues: Iterable[KnownIssue] | None = None) -> list[Finding]:
    """The findings of one check on one case with the ledger applied (see the module's docstring)."""
    issues = ledger() if issues is None else tuple(issues)
    findings = list(findings)
    # The entries that allow a measured failure of this check on this case: the same check's observation with
    # no ratio (a graph replay that differs from its eager call) comes with that error and is the same cause.
    claimed = {
        i.id
        for f in findings
        if f.verdict == "fail" and f.errors is not None and f.backend != SUITE_BACKEND
        for i in issues
        if i.allowed > 0 and i.matches(f) and _allows(i, f)
    }
    result = []
    for finding in findings:
        if finding.verdict == "error" and finding.backend != SUITE_BACKEND:
            result.append(_known_error(finding, issues))
            continue
        matching = [i for i in issues if i.matches(finding)]
        if finding.errors is None:
            # A check's observation with no error over a limit (outputs before a token moved by later inputs, a
            # state a second call changed): only an entry that bounds nothing (worst inf, a broken kernel on
            # its cases) claims it, as it claims any size of error there, or one that allows this case's
            # measured error on the same check. A pass of that kind measured nothing an entry could still
            # reproduce.
            wanted = [i for i in matching if math.isinf(i.allowed) or i.id in claimed]
            matching = wanted if finding.verdict == "fail" else []
        elif finding.verdict == "fail":
            # An entry of crashes alone measured no numbers: a wrong result on its cases is some other cause.
            matching = [i for i in matching if i.allowed > 0]
        if not matching:
            result.append(finding)
        elif finding.verdict == "fail":
            # Several entries can match one failure (a dtype's rounding and a check's broken contract): the
            # failure is known when any of them allows it, and judged against the widest one otherwise.
            allowing = [i for i in matching if finding.errors is None or _allows(i, finding)]
            if allowing:
                issue = allowing[0]
                reason = f"known issue {issue.id}: {issue.description} ({issue.upstream})"
                observed = f"known: {issue.id}"
                result.append(
                    dataclasses.replace(
                        finding, verdict="known", observed=observed, reason=reason, known_issue=issue.id
                    )
                )
            else:
                widest = max(matching, key=lambda i: i.allowed)
                worse = f"worse than known issue {widest.id} allows: {finding.worst:.3g} of the limit"
                worse += f" > {widest.allowed:.3g}"
                result.append(dataclasses.replace(finding, problems=(*finding.problems, worse), known_issue=widest.id))
        elif finding.passed and any(i.always_fails for i in matching):
            # Matched and passed: the run tells whether the entry still reproduces anywhere.
            issue = next(i for i in matching if i.always_fails)
            result.append(dataclasses.replace(finding, known_issue=issue.id))
        else:
            result.append(finding)
    return result


def _allows(issue: KnownIssue, finding: Finding) -> bool:
    """Whether ``issue`` allows the error ``finding`` measured: within its worst x growth, or any where it bounds
    nothing."""
    return finding.worst <= issue.allowed or math.isinf(issue.allowed)


def _known_error(finding: Finding, issues: tuple[KnownIssue, ...]) -> Finding:
    """A backend's error that an entry names by words of its message is ``known``, its message kept."""
    for issue in issues:
        if issue.names_error(finding.reason) and issue.matches(finding):
            reason = f"known issue {issue.id}: {finding.reason} ({issue.upstream})"
            return dataclasses.replace(
                finding, verdict="known", observed=f"known: {issue.id}", reason=reason, known_issue=issue.id
            )
    return finding
