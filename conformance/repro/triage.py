"""Triage: which one change makes a finding go away (``kda-conformance triage``).

Each untriaged finding's smallest case is rerun, by its own repro line, in a process of its own, first as it
failed, then with one switch at a time that separates the causes seen in KDA kernels:

- IEEE dots: ``TRITON_F32_DEFAULT=ieee`` (the library's own precision switch where a backend names one), set
  before anything compiles: TF32 where the library does not declare it;
- the zero-length members removed from ``cu_seqlens``: chunk indices that miscount empty sequences;
- contiguous inputs: a kernel that reads strided views as contiguous;
- a fresh ``cu_seqlens`` tensor (the budget check instead of the reused-tensor one): metadata cached on the
  tensor's identity;
- another chunk size, where the kernel's API takes one (a backend names its variants): a chunk-size bug;
- an fp32 state: a state precision the kernel does not keep.

A switch under which the finding passes while it fails without names its cause; every rerun's command, exit
and verdict is kept, so the ledger's ``confirmed`` field can cite the triage run (triage.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kda_cases.case import Case
from kda_conformance.checks import CHECKS
from kda_conformance.judging.known import LEDGER_VARIABLE
from kda_conformance.judging.repro import BUDGET_CHECK, repro_line
from kda_kernels import registry
from kda_kernels.left_work import kill_tree
from kda_kernels.protocol import Backend
from kda_kernels.registry import plugin_module

# The exits of a rerun (docs/exit-codes.md) and what they say of the case. A negative exit is the process
# killed by that signal during the backend's call (an abort in a CUDA extension): the finding's "process
# ended" reproduced, and a switch that turns it into a pass names its cause as for any failure.
EXITS = {0: "passes", 1: "fails", 3: "errs", 5: "does not run"}
LAUNCH = "import sys; from kda_conformance.cli import main; sys.exit(main(sys.argv[1:]))"


def _fails(rerun: Rerun) -> bool:
    return rerun.exit is not None and (rerun.exit in (1, 3) or rerun.exit < 0)


def _outcome(exit: int) -> str:
    if exit < 0:
        try:
            return f"dies of {signal.Signals(-exit).name}"
        except ValueError:
            return f"dies of signal {-exit}"
    return EXITS.get(exit, f"exit {exit}")


@dataclass(frozen=True)
class Rerun:
    """One rerun of a finding's case: its switch, why it does not apply (then nothing ran), the command (with
    its environment changes) and what it gave."""

    switch: str
    command: str = ""
    environment: dict[str, str] = dataclasses.field(default_factory=dict)
    exit: int | None = None
    not_applied: str = ""
    timed_out: float | None = None  # the seconds after which the rerun was stopped, if it was

    @property
    def outcome(self) -> str:
        if self.not_applied:
            return f"n/a ({self.not_applied})"
        if self.timed_out is not None:
            return f"stopped after {self.timed_out:g} s"
        return _outcome(self.exit) if self.exit is not None else "not run"


@dataclass(frozen=True)
class Triage:
    finding: str
    backend: str
    check: str
    case_id: str
    reruns: tuple[Rerun, ...]

    @property
    def reproduces(self) -> bool:
        return bool(self.reruns) and _fails(self.reruns[0])

    @property
    def clearing(self) -> list[str]:
        """The switches under which the finding passes."""
        return [r.switch for r in self.reruns[1:] if r.exit == 0]

    @property
    def cause(self) -> str:
        if self.reruns and self.reruns[0].timed_out is not None:
            return f"not established (as it failed, it was {self.reruns[0].outcome})"
        if not self.reruns or self.reruns[0].exit is None:
            return "not run"
        if not self.reproduces:
            return f"does not reproduce here (it {self.reruns[0].outcome})"
        clearing = self.clearing
        if clearing:
            return "; ".join(clearing)
        # "No switch clears it" only where every switch that applies ran to its end: one stopped by its time
        # limit (or never run) might have cleared it.
        unfinished = [r for r in self.reruns[1:] if not r.not_applied and (r.timed_out is not None or r.exit is None)]
        if unfinished:
            said = ", ".join(f"{r.switch} {r.outcome}" for r in unfinished)
            return f"not established (no switch that ran clears it; {said})"
        return "not established (no single switch clears it)"


@dataclass(frozen=True)
class Rerunnable:
    """What a repro line reruns: the check, its case, backend, device, parameters, and the plugins the rerun
    loads (the command line's, never the line's: ``named_plugins`` are the ones the recorded line names)."""

    check: str
    case: Case
    backend: str
    device: str
    params: dict[str, object]
    plugins: tuple[str, ...]
    named_plugins: tuple[str, ...] = ()

    @property
    def missing_plugins(self) -> tuple[str, ...]:
        """The plugins the recorded line names that the command line does not load."""
        given = {plugin_module(p) for p in self.plugins}
        return tuple(p for p in self.named_plugins if plugin_module(p) not in given)

    def line(self) -> str:
        line = repro_line(self.check, self.case, self.backend, self.device, self.params)
        words = shlex.split(line)
        named = {plugin_module(w) for w, before in zip(words[1:], words, strict=False) if before == "--plugin"}
        extra = [registry.plugin_argument(plugin_module(p)) for p in self.plugins if plugin_module(p) not in named]
        plugins = "".join(f" --plugin {shlex.quote(p)}" for p in extra)
        backend = f" --backend {shlex.quote(self.backend)}"
        return line.replace(backend, plugins + backend)


def parse_repro(line: str, parser: argparse.ArgumentParser, plugins: Sequence[str] = ()) -> Rerunnable:
    """A recorded repro line (``kda-conformance run|repro ... --case JSON``) read back by the CLI's own parser.
    A store is data: the modules its line names with ``--plugin`` are kept aside (``named_plugins``), and the
    rerun loads only ``plugins``, the ones the person running it named."""
    words = shlex.split(line)
    args = parser.parse_args(words[1:])
    check = getattr(args, "check", BUDGET_CHECK) if args.command == "repro" else BUDGET_CHECK
    params = {p.name: getattr(args, p.name) for p in CHECKS[check].params if getattr(args, p.name, None) is not None}
    backend = args.backend if args.command == "repro" else args.backends[0]
    case = args.case if args.command == "repro" else args.cases[0]  # run's --case repeats
    return Rerunnable(check, case, backend, args.device, params, tuple(plugins), tuple(args.plugin))


# A switch: its name and, for a rerunnable finding on a backend, either why it does not apply or the
# rerun it makes and the environment it sets.
SwitchRule = Callable[[Rerunnable, Backend], "tuple[str, Rerunnable | None, dict[str, str]]"]


def _ieee(r: Rerunnable, backend: Backend) -> tuple[str, Rerunnable | None, dict[str, str]]:
    # Any dtype: bf16 and fp16 kernels keep float32 intermediates (FLA's inverse) that TF32 dots round.
    return "", r, dict(backend.ieee_switch)


def _no_empty(r: Rerunnable, backend: Backend) -> tuple[str, Rerunnable | None, dict[str, str]]:
    if not r.case.has_empty_sequence:
        return "no zero-length member", None, {}
    lengths = tuple(n for n in r.case.seq_lens if n)
    # Checkpoints name sequences by their index: renumbered past the removed members.
    kept = [i for i, n in enumerate(r.case.seq_lens) if n]
    checkpoints = tuple((kept.index(s), p) for s, p in r.case.checkpoints if s in kept)
    case = r.case.replace(seq_lens=lengths, checkpoints=checkpoints, packed=len(lengths) > 1 or r.case.packed)
    return "", dataclasses.replace(r, case=case), {}


def _contiguous(r: Rerunnable, backend: Backend) -> tuple[str, Rerunnable | None, dict[str, str]]:
    if r.case.input_layout == "contiguous":
        return "its inputs are contiguous", None, {}
    return "", dataclasses.replace(r, case=r.case.replace(input_layout="contiguous")), {}


def _fresh_cu_seqlens(r: Rerunnable, backend: Backend) -> tuple[str, Rerunnable | None, dict[str, str]]:
    if r.check != "cu_seqlens":
        return "not the reused-tensor check", None, {}
    return "", dataclasses.replace(r, check=BUDGET_CHECK, params={}), {}


def _chunk(r: Rerunnable, backend: Backend) -> tuple[str, Rerunnable | None, dict[str, str]]:
    others = [name for name in backend.chunk_variants if name in registry.names()]
    if not others:
        return "its API takes one chunk size", None, {}
    return "", dataclasses.replace(r, backend=others[0]), {}


def _fp32_state(r: Rerunnable, backend: Backend) -> tuple[str, Rerunnable | None, dict[str, str]]:
    if r.case.state_dtype == "fp32":
        return "its state is fp32", None, {}
    return "", dataclasses.replace(r, case=r.case.replace(state_dtype="fp32")), {}


SWITCHES: dict[str, SwitchRule] = {
    "IEEE dots": _ieee,
    "zero-length members removed": _no_empty,
    "contiguous inputs": _contiguous,
    "a fresh cu_seqlens tensor": _fresh_cu_seqlens,
    "another chunk size": _chunk,
    "an fp32 state": _fp32_state,
}


def launch(
    r: Rerunnable,
    out: Path,
    env: dict[str, str],
    timeout: float | None,
    environment: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
) -> tuple[str, int | None]:
    """Run ``r``'s line in a process of its own (behind ``prefix``: a tool that runs it, as compute-sanitizer
    does), its records to ``out``, with ``environment`` set: the command as a person would type it, and its
    exit (None where it was stopped after ``timeout`` seconds)."""
    environment = environment or {}
    line = r.line()
    words = shlex.split(line)[1:]
    words += ["--out", str(out)] + (["--no-dashboard"] if words[0] == "run" else [])
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in environment.items())
    command = " ".join(filter(None, (shown, shlex.join(prefix), line)))
    process = subprocess.Popen(
        [*prefix, sys.executable, "-c", LAUNCH, *words],
        env={**env, **environment},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # a compile that takes the GPU host minutes, a hang: said, not waited on
        # With its children: an --isolate worker holds the GPU, and it outlived the rerun killed alone.
        kill_tree(process.pid)
        process.communicate()
        return command, None
    return command, process.returncode


def _rerun(
    switch: str, r: Rerunnable, environment: dict[str, str], out: Path, env: dict[str, str], timeout: float | None
) -> Rerun:
    """One rerun, the ledger off: a failure the ledger knows exits 0 as a pass does, and triage asks whether the
    case fails (an H100 read FLA's known TF32 backward finding as "does not reproduce here")."""
    environment = {**environment, LEDGER_VARIABLE: ""}
    command, exit = launch(r, out, env, timeout, environment)
    if exit is None:
        return Rerun(switch, command, environment, timed_out=timeout)
    return Rerun(switch, command, environment, exit)


def triage(
    finding_id: str,
    repro: str,
    parser: argparse.ArgumentParser,
    out: Path,
    env: dict[str, str] | None = None,
    plugins: Sequence[str] = (),
    jobs: int = 1,
    timeout: float | None = None,
) -> Triage:
    """Rerun one finding's case (its repro line) as it failed and with each switch alone, each in a process of
    its own (a compile-time switch must be set before anything compiles; ``jobs`` of them at once; each stopped
    after ``timeout`` seconds), loading only ``plugins``; records go to ``out``. A switch's result counts only
    where the case fails as it failed. With one job the switches wait for that answer; with more, the rerun as it
    failed starts beside them: a GPU host's compile of one rerun takes minutes, and waiting doubled a finding's
    wall time (an H100 cut two findings' triage at 420 s), while the runs wasted on a finding that does not
    reproduce are only CPU time."""
    env = dict(os.environ if env is None else env)
    r = parse_repro(repro, parser, plugins)
    backend = registry.get(r.backend)
    rules = {name: rule(r, backend) for name, rule in SWITCHES.items()}
    runnable = {
        name: (changed, env_) for name, (why, changed, env_) in rules.items() if not why and changed is not None
    }
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        first_run = pool.submit(_rerun, "as it failed", r, {}, out, env, timeout)
        if jobs <= 1 and not _fails(first_run.result()):
            runnable = {}
        # The reruns are processes of their own and independent: on a GPU host, compiling dominates and is
        # CPU-bound, so several at once finish a finding in the time of its slowest rerun.
        pending = {
            name: pool.submit(_rerun, name, changed, environment, out, env, timeout)
            for name, (changed, environment) in runnable.items()
        }
        first = first_run.result()
        if not _fails(first):  # nothing to separate: a switch can only clear what fails here
            for future in pending.values():
                future.cancel()
            skipped = [Rerun(name, not_applied=f"it {first.outcome} as it failed") for name in SWITCHES]
            return Triage(finding_id, r.backend, r.check, r.case.id, (first, *skipped))
        switched = [pending[n].result() if n in pending else Rerun(n, not_applied=rules[n][0]) for n in SWITCHES]
    return Triage(finding_id, r.backend, r.check, r.case.id, (first, *switched))


def triage_markdown(results: list[Triage], source: str) -> str:
    names = list(SWITCHES)
    lines = [
        "# Triage",
        "",
        f"`kda-conformance triage` over {source}: each untriaged finding's smallest case rerun as it failed, then "
        "with one switch at a time (conformance/repro/triage.py); a switch under which it passes names its cause. "
        "Every rerun's command and exit is in triage.json beside this page.",
        "",
        "| finding | backend | check | case | as it failed | " + " | ".join(names) + " | cause |",
        "|" + "---|" * (len(names) + 6),
    ]
    for t in results:
        by = {r.switch: r.outcome for r in t.reruns}
        cells = [t.finding, t.backend, t.check, t.case_id, by.get("as it failed", "-")]
        cells += [by.get(n, "-") for n in names]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in [*cells, t.cause]) + " |")
    return "\n".join(lines) + "\n"


def triage_json(results: list[Triage]) -> str:
    return json.dumps(
        [
            {**{k: v for k, v in dataclasses.asdict(t).items() if k != "reruns"}, "cause": t.cause,
             "reruns": [{**dataclasses.asdict(r), "outcome": r.outcome} for r in t.reruns]}
            for t in results
        ],
        indent=1,
    )  # fmt: skip


def said_of_findings(files: Sequence[Path], field: str) -> dict[str, str]:
    """What the JSON files of triage (``cause``) or sanitize (``summary``) say of each finding, with the file it
    is read from, keyed by the finding's id and by its smallest case and check (an id made by older code still
    finds its finding); a later file's word on a finding wins."""
    said = {}
    for path in files:
        for entry in json.loads(Path(path).read_text()):
            text = f"{entry[field]} ({Path(path).parent.name}/{Path(path).name})"
            said[str(entry["finding"])] = said[f"{entry['case_id']} {entry['check']}"] = text
    return said
