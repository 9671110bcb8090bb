"""``kda-conformance ledger``: the ledger of known upstream problems (conformance/known_issues.toml) as a page,
docs/known-issues.md, every entry in it: what it matches, where each library's copy of the code lives, where the
problem is tracked upstream and its status there. A test holds the committed page to the ledger."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from kda_cases.files import atomic_write_text
from kda_conformance.cli.common import say
from kda_conformance.judging.known import LEDGER, KnownIssue, load_ledger

EXAMPLE = "kda-conformance ledger --page docs/known-issues.md"

INTRO = """\
# Known issues, tracked

`conformance/known_issues.toml` is a committed ledger of known upstream problems, one entry per cause. This
page is generated from it (`kda-conformance ledger --page docs/known-issues.md`; a test holds it to the
ledger), every entry in it.

Each entry names the backends, the checks (optional), the device, the cases it matches (case fields and their
values), the environment it depends on (variables and their values, `""` for unset), the tensors it lets fail
(optional; every tensor by default), the worst error/limit seen when it was added and a growth factor, whether
it always fails, a description, where the code is and what was read there, how its cause was confirmed
(required: an entry that does not say is refused; where `kda-conformance triage` separated the cause, it cites
that run's triage.json), the date it was added, and where the problem is tracked
upstream, with its status there (required: an issue, a PR, a fixing commit, or `none` and why). One cause in
several libraries' copies of one code path (FLA's `prepare_chunk_indices`, copied into AITER, vLLM and SGLang) is
one entry that names each copy, where it lives and the backends that run it; an entry that took over earlier
ones names their ids (`replaces`), and the records that name them are its. An entry may also name words of the
backend's own error message (`raises`): such an error is `known` too, its message kept in the reason (a
device-killing error never is: it still quarantines the configuration). Words of a crash's message
(`crashes`: a device-killing error, or the process ending inside the backend's call) leave the crash an error in
its run (the device or the worker is lost, the run exits 3), but the findings page lists it under the entry
instead of as a new finding every night. An entry of crashes alone (`worst = 0`, shown as *crashes only*: a
launch that fails measured no numbers) claims no failure with numbers on its cases. The backend's other errors,
and the suite's, stay errors.

An entry matches an issue, not a tensor. Among the findings of one check on one case, a failure that matches
an entry is reported as `known`: not a pass, not a failure; the case's other tensors that pass stay passes.
`known` is its own verdict in the records (with the entry in `known_issue`), on the dashboard (the verdict
counts and the table of observations: `known: <id>`) and in pytest's summary (the section *known issues,
marginal failures and warnings*). It fails again when it gets worse than `worst` x `growth` (the message says
by how much; where several entries match one failure, it is known if any of them allows it).

Whether an entry that `always_fails` still reproduces is a question about the whole run: when every case it
matched passed, the problem is gone, and the console (pytest's summary, `run`'s report) and the dashboard
(*Known issues that no longer reproduce*) say to remove it: a warning, and a failure under `--kda-strict` /
`--strict`.

A precision a library states in its own code (FLA's TF32 dots, FlashKDA's bf16 state) is not in the ledger: it
is a declared working precision, judged at that precision, its cost shown apart
([tolerance.md](tolerance.md#a-declared-working-precision)).

Apply it in code with `kda_conformance.judging.known.apply_known(findings)`; every check's findings pass through
it (`Run.checked`). A run applies another ledger where `KDA_LEDGER` names its file, and none where it is set
empty: `kda-conformance triage` reruns every case so (`KDA_LEDGER=''` in each rerun's command), since a failure
the ledger knows exits 0 as a pass does, and triage asks whether the case fails, known or not.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ledger", type=Path, default=LEDGER, metavar="FILE", help="the ledger of known issues")
    parser.add_argument("--page", type=Path, default=None, metavar="FILE", help="write the page here")


def _matches(issue: KnownIssue) -> str:
    parts = [f"{name} in {', '.join(map(str, values))}" for name, values in issue.when.items()]
    parts += [f"check {', '.join(issue.checks)}"] if issue.checks else []
    parts += [f"observed {', '.join(issue.observed)}"] if issue.observed else []
    parts += [f"tensors {', '.join(issue.tensors)}"] if issue.tensors else []
    parts += [f"on {issue.device}"] if issue.device else []
    parts += [f"{name} {' or '.join(repr(v) for v in values)}" for name, values in issue.environment.items()]
    parts += [f"the error says {' or '.join(repr(r) for r in issue.raises)}"] if issue.raises else []
    parts += [f"it crashes: {' or '.join(repr(r) for r in issue.crashes)}"] if issue.crashes else []
    return "; ".join(parts) or "every case"


def ledger_markdown(issues: tuple[KnownIssue, ...]) -> str:
    """The page: the ledger's rules, a table of every entry, then each entry whole."""
    lines = [INTRO, f"The ledger holds {len(issues)} entries today.", ""]
    lines += ["| id | backends | matches | upstream | worst |", "|---|---|---|---|---|"]
    for issue in issues:
        links = "; ".join(
            link.status.split(":")[0] if link.kind == "none" else f"{link.ref}: {link.status.split(':')[0]}"
            for link in issue.links
        )
        backends = ", ".join(f"`{b}`" for b in issue.backends)
        worst = f"{issue.worst:g} x {issue.growth:g}" if issue.allowed else "crashes only"
        cells = [f"[`{issue.id}`](#{issue.id})", backends, _matches(issue), links, worst]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    for issue in issues:
        lines += ["", f"## {issue.id}", "", issue.description, "", f"Where: {issue.upstream}", ""]
        lines += [f"Confirmed: {issue.confirmed}", "", f"Added {issue.added}."]
        if issue.copies:
            lines += ["", "Copies of the code path:", ""]
            lines += [f"- {c.library}: {c.where} ({', '.join(f'`{b}`' for b in c.backends)})" for c in issue.copies]
        lines += ["", "Tracked upstream:", ""]
        for link in issue.links:
            lines.append(f"- {link.text(f'[{link.ref}]({link.url})' if link.url else None)}")
        if issue.replaces:
            lines += ["", f"Takes over the earlier entries {', '.join(f'`{r}`' for r in issue.replaces)}."]
    return "\n".join(lines) + "\n"


def execute(args: argparse.Namespace, console: Console) -> int:
    try:
        issues = load_ledger(args.ledger)
    except (OSError, ValueError) as exc:
        say(console, str(exc), "error:", "red")
        return 2
    text = ledger_markdown(issues)
    if args.page is None:
        console.print(text, markup=False, highlight=False, soft_wrap=True)
        return 0
    try:
        atomic_write_text(args.page, text)
    except OSError as exc:
        say(console, f"--page {args.page}: {exc}", "error:", "red")
        return 2
    console.print(f"page: {args.page} ({len(issues)} entries)", highlight=False)
    return 0
