"""A smaller case that fails the same check in the same way: greedy search over cases/shrink.py's
reductions within a time budget, for ``kda-conformance minimize``.

"The same way": the first failure of the original (its tensor, and whether it was non-finite values,
values over the limit, a raised error or another problem) is among the candidate's failures. A candidate
outside the backend's envelope is not run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from kda_cases.case import Case
from kda_cases.shrink import size, smaller_cases
from kda_conformance.checks import Check, run_check
from kda_conformance.running.run import Run
from kda_kernels import guard
from kda_kernels.guard import BackendFault
from kda_kernels.protocol import Backend
from kda_reports.findings import Finding


def failure_kinds(findings: list[Finding]) -> list[tuple[str, str]]:
    """``(tensor, kind)`` of each failed finding, in order: kind ``error``, ``non-finite``, ``over limit``
    or ``problem``."""
    kinds = []
    for finding in findings:
        if not finding.failed:
            continue
        if finding.verdict == "error":
            kinds.append((finding.tensor, "error"))
        elif finding.errors is not None and finding.errors.nonfinite:
            kinds.append((finding.tensor, "non-finite"))
        elif finding.errors is not None:
            kinds.append((finding.tensor, "over limit"))
        else:
            kinds.append((finding.tensor, "problem"))
    return kinds


@dataclass
class Minimized:
    original: Case
    case: Case
    failure: tuple[str, str] | None  # the (tensor, kind) kept; None when the case does not fail
    findings: list[Finding]  # the minimal case's
    original_findings: list[Finding]  # the given case's
    tried: int
    seconds: float
    stopped_by_budget: bool


def minimize(
    check: Check,
    case: Case,
    backend: Backend,
    device: torch.device,
    params: Mapping[str, object] | None = None,
    budget_s: float = 300.0,
    progress: Callable[[str], None] | None = None,
    run: Run | None = None,
) -> Minimized:
    """The smallest case found that fails ``check`` as ``case`` does (``failure`` None, and nothing tried,
    when ``case`` does not fail: its findings say whether it passed or did not run). Every candidate runs
    through ``run``'s executor (a run of its own where None is given)."""
    start, params, original = time.monotonic(), dict(params or {}), case
    findings = first = run_check(check, case, backend, device, params, run)
    kinds = failure_kinds(findings)
    if not kinds:
        return Minimized(original, case, None, findings, first, 0, time.monotonic() - start, False)
    wanted, tried = kinds[0], 0

    def fails(candidate: Case) -> list[Finding] | None:
        """The candidate's findings when it fails the same way (None otherwise, or outside the envelope)."""
        nonlocal tried
        try:
            candidate = guard.fit(backend, candidate)
            if size(candidate) >= size(case) or not guard.supports(backend, candidate):
                return None
        except BackendFault:  # it cannot answer for the candidate: the original's error stands
            return None
        tried += 1
        got = run_check(check, candidate, backend, device, params, run)
        return got if wanted in failure_kinds(got) else None

    def out_of_time() -> bool:
        return time.monotonic() - start > budget_s

    improved = True
    while improved and not out_of_time():
        improved = False
        for candidate in smaller_cases(case):  # one step at a time, simplest first
            if out_of_time():
                break
            got = fails(candidate)
            if got is not None:
                case, findings, improved = got[0].case, got, True
                if progress is not None:
                    progress(f"still fails ({wanted[1]} {wanted[0] or ''}): {case.label}")
                break
        # Then the shortest failing length of each sequence by bisection (the boundary lengths above may
        # stop short of it: a bug at token 33 needs 34 tokens).
        for seq in range(case.num_seqs):
            low, high = 0, case.seq_lens[seq]  # low passes (or is empty), high fails
            while high - low > 1 and not out_of_time():
                mid = (low + high) // 2
                lens = (*case.seq_lens[:seq], mid, *case.seq_lens[seq + 1 :])
                if not case.packed:
                    lens = (mid,) * case.num_seqs
                try:
                    shorter = case.replace(seq_lens=lens, checkpoints=())
                except ValueError:  # no token left
                    low = mid
                    continue
                got = fails(shorter)
                if got is None:
                    low = mid
                else:
                    case, findings, high, improved = got[0].case, got, mid, True
                    if progress is not None:
                        progress(f"still fails ({wanted[1]} {wanted[0] or ''}): {case.label}")
    return Minimized(original, case, wanted, findings, first, tried, time.monotonic() - start, out_of_time())
