"""The exit codes every ``kda-conformance`` command returns, and how a run's verdicts become one.

The same five outcomes everywhere, so that a CI step can tell a kernel that is wrong from one that crashed,
from a job that tested nothing (docs/exit-codes.md lists each command's).
"""

from __future__ import annotations

from collections.abc import Iterable

from kda_conformance.running.not_checked import NOT_CHECKED_EXIT, accepts_resource

PASSED = 0  # everything that ran passed (known issues and warnings included, but under --kda-strict)
FAILED = 1  # a kernel failed a check: a tensor out of its limits, memory it must not write, a strict warning
USAGE = 2  # a bad option or input, a plugin that cannot load, an unwritable output folder, a run id that exists
ERRORED = 3  # nothing failed, but something raised, crashed or hung: a backend (its rows) or the suite's own code
# nothing failed or raised, but a case did not run for want of memory (a resource verdict); pytest's too
NOT_CHECKED = NOT_CHECKED_EXIT
NOTHING_RAN = 5  # no case ran on any selected backend (every one skipped or out of memory), as pytest's 5
INTERRUPTED = 130  # Ctrl-C or a time limit's SIGTERM; what ran is kept

# What each outcome means, for the commands' help and docs/exit-codes.md.
MEANINGS = {
    PASSED: "passed: everything that ran passed (known issues, marginal failures and warnings do not fail, but "
    "warnings under strict mode)",
    FAILED: "failed: a kernel failed a check (a tensor out of its limits, a broken call contract, a warning "
    "under strict mode, a ledger entry that no longer reproduces under strict mode)",
    USAGE: "usage: a bad option or input, a plugin that cannot load, an output folder that cannot be written, "
    "a run id that exists; a read or write of the suite's own files that fails mid-command (a full disk, a "
    "read-only store or `--junit-xml` path): one line naming the path, what was written before it kept (a run's "
    "rows so far in its journal)",
    ERRORED: "errored: nothing failed, but a backend raised, crashed or hung, or the suite's own code raised "
    "(the records' backend column names who)",
    NOT_CHECKED: "not checked: nothing failed or erred, but a case did not run for want of memory (a `resource` "
    "verdict): a kernel never judged there is no pass (`KDA_ACCEPT_RESOURCE=1` counts it as a skip)",
    NOTHING_RAN: "nothing ran: every selected backend skipped every case (unsupported, unavailable)",
    INTERRUPTED: "interrupted: Ctrl-C or SIGTERM; what ran is kept",
}

JUDGED = ("pass", "fail", "known", "warn", "marginal", "error")


def verdict_exit(verdicts: Iterable[str], strict: bool = False, accept_resource: bool | None = None) -> int:
    """The exit code of a run's verdicts: FAILED over ERRORED over NOT_CHECKED over NOTHING_RAN over PASSED.
    ``accept_resource`` (default: ``KDA_ACCEPT_RESOURCE=1``) counts a resource verdict as a skip."""
    seen = set(verdicts)
    if accept_resource is None:
        accept_resource = accepts_resource()
    if "fail" in seen or (strict and "warn" in seen):
        return FAILED
    if "error" in seen:
        return ERRORED
    if "resource" in seen and not accept_resource:
        return NOT_CHECKED
    if not seen & set(JUDGED):
        return NOTHING_RAN
    return PASSED
