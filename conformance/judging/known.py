"""The ledger of known upstream problems (``conformance/known_issues.toml``), applied to findings.

A failed finding that matches an entry becomes ``known`` while its worst error/limit stays within the
entry's ``worst`` x ``growth``, and stays a failure (saying so) beyond it. A passing finding that matches an
entry marked ``always_fails`` is a failure: the problem no longer reproduces, and the entry must go.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kda_reports.findings import Finding

LEDGER = Path(__file__).resolve().parent.parent / "known_issues.toml"


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

    @property
    def allowed(self) -> float:
        """The worst error/limit a matching failure may reach and still be this issue."""
        return self.worst * self.growth

    def matches(self, finding: Finding) -> bool:
        if finding.backend not in self.backends or (self.checks and finding.check not in self.checks):
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
                    "backends": tuple(entry["backends"]),
                    "checks": tuple(entry.get("checks", ())),
                    "observed": tuple(entry.get("observed", ())),
                    "when": {k: tuple(v) for k, v in entry.get("when", {}).items()},
                    "environment": {k: tuple(v) for k, v in entry.get("environment", {}).items()},
                }
            )
        except (TypeError, KeyError) as exc:
            raise ValueError(
                f"{Path(path).name}: issue {number} ({entry.get('id', '?')}) is not valid: {exc}"
            ) from None
        issues.append(issue)
    return tuple(issues)


@functools.cache
def ledger() -> tuple[KnownIssue, ...]:
    return load_ledger()


def apply_known(findings: Iterable[Finding], issues: Iterable[KnownIssue] | None = None) -> list[Finding]:
    """``findings`` with the ledger applied (see the module's docstring)."""
    issues = ledger() if issues is None else tuple(issues)
    result = []
    for finding in findings:
        matching = [i for i in issues if i.matches(finding)]
        if not matching or finding.errors is None:
            result.append(finding)
        elif finding.verdict == "fail":
            # Several entries can match one failure (a dtype's rounding and a check's broken contract): the
            # failure is known when any of them allows it, and judged against the widest one otherwise.
            allowing = [i for i in matching if finding.worst <= i.allowed]
            if allowing:
                issue = allowing[0]
                reason = f"known issue {issue.id}: {issue.description} ({issue.upstream})"
                result.append(
                    dataclasses.replace(finding, verdict="known", observed=f"known: {issue.id}", reason=reason)
                )
            else:
                widest = max(matching, key=lambda i: i.allowed)
                worse = f"worse than known issue {widest.id} allows: {finding.worst:.3g} of the limit"
                worse += f" > {widest.allowed:.3g}"
                result.append(dataclasses.replace(finding, problems=(*finding.problems, worse)))
        elif finding.passed and any(i.always_fails for i in matching):
            issue = next(i for i in matching if i.always_fails)
            gone = f"known issue {issue.id} no longer reproduces (the case passes): remove it from the ledger"
            result.append(dataclasses.replace(finding, verdict="fail", problems=(gone,), observed=f"gone: {issue.id}"))
        else:
            result.append(finding)
    return result
