"""``kda-conformance triage``: rerun each untriaged finding's smallest case with one switch at a time (IEEE dots,
the zero-length members removed, contiguous inputs, a fresh cu_seqlens tensor, another chunk size, an fp32 state)
and name the switch that clears it (conformance/repro/triage.py)."""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

import pandas as pd
from rich.console import Console

from kda_cases.case import Case
from kda_cases.files import atomic_write_text
from kda_conformance.cli.common import say
from kda_conformance.cli.findings import store_findings
from kda_conformance.judging.known import LEDGER
from kda_conformance.repro.triage import parse_repro, triage, triage_json, triage_markdown
from kda_conformance.running.option_values import parse_count, parse_positive
from kda_conformance.running.options import typed
from kda_kernels import autotune_replay

EXAMPLE = "kda-conformance triage --store nightly-store"


def add_rerun_arguments(parser: argparse.ArgumentParser, command: str, default_findings: str) -> None:
    """The options of the commands that rerun a store's findings (triage, sanitize): what to read and rerun,
    where the pages go, and how long a rerun may take."""
    parser.add_argument("--store", type=Path, required=True, metavar="DIR", help="the store (or run folder) to read")
    parser.add_argument(
        "--finding",
        action="append",
        default=[],
        metavar="ID",
        help=f"a finding to rerun, of any status (repeatable; default: {default_findings})",
    )
    parser.add_argument(
        "--out", type=Path, default=None, metavar="DIR", help=f"where {command}.md, {command}.json and the reruns' "
        f"records go (default: STORE/{command})",
    )  # fmt: skip
    parser.add_argument("--ledger", type=Path, default=LEDGER, metavar="FILE", help="the ledger of known issues")
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="module that registers backends (repeatable); the plugins a store's repro lines name are loaded only "
        "when given here, and a finding whose line names others is not rerun",
    )
    parser.add_argument(
        "--rerun-timeout",
        type=typed(lambda text: parse_positive("--rerun-timeout", text)),
        default=None,
        metavar="S",
        help="stop a rerun after S seconds, recorded as stopped (default: none)",
    )
    parser.add_argument(
        "--autotune-replay",
        type=Path,
        default=None,
        metavar="FILE_OR_DIR",
        help="the autotune choices every rerun launches: a replay file, or the folder the failing run recorded "
        "into (KDA_AUTOTUNE_RECORD=DIR), merged into OUT/autotune-replay.json; a failure that follows autotune's "
        "choice does not come back in a rerun that tunes afresh (default: the GPU model's file, keys it lacks "
        "tuned anew)",
    )


def rerun_setup(
    args: argparse.Namespace, records: pd.DataFrame, command: str, console: Console
) -> tuple[Path, dict[str, str], str] | None:
    """What the commands that rerun findings share before their first rerun: the folder their pages go to (made),
    the reruns' environment, and the runs the pages say they read; None (said) where ``--autotune-replay`` holds
    no choices."""
    out = args.out or (args.store if args.store.is_dir() else args.store.parent) / command
    out.mkdir(parents=True, exist_ok=True)
    try:
        env, replaying = rerun_environment(args, out)
    except ValueError as exc:
        say(console, str(exc), "error:", "red")
        return None
    return out, env, ", ".join(sorted(records["run_id"].astype(str).unique())) + replaying


def rerun_environment(args: argparse.Namespace, out: Path) -> tuple[dict[str, str], str]:
    """The reruns' environment and what the pages say of it: this one, with ``--autotune-replay``'s choices in
    KDA_AUTOTUNE_REPLAY where given. Raises ValueError naming the option where it holds no choices."""
    env = dict(os.environ)
    given = args.autotune_replay
    if given is None:
        return env, ""
    if given.is_dir():
        parts = autotune_replay.parts(given)
        if not parts:
            raise ValueError(f"--autotune-replay {given}: no autotune-<pid>.json in it (KDA_AUTOTUNE_RECORD's parts)")
        try:
            device, triton, choices = autotune_replay.merge(parts)
        except (ValueError, KeyError) as exc:
            raise ValueError(f"--autotune-replay {given}: {exc}") from None
        path = autotune_replay.write(
            out / "autotune-replay.json", device, triton, choices, command=f"the {len(parts)} parts in {given}"
        )
    elif given.is_file():
        path = given
    else:
        raise ValueError(f"--autotune-replay {given}: neither a replay file nor a folder of recorded parts")
    env[autotune_replay.REPLAY_VARIABLE] = str(path.resolve())
    return env, f"; every rerun replays the autotune choices of {path}"


def plugins_missing(
    finding_id: str, repro: str, plugins: list[str], parser: argparse.ArgumentParser, console: Console
) -> bool:
    """Whether the repro line loads plugins the command line does not (said): a store is data, and the modules
    it names are never imported on its say-so."""
    missing = parse_repro(repro, parser, plugins).missing_plugins
    if missing:
        named = " ".join(f"--plugin {shlex.quote(p)}" for p in missing)
        say(console, f"{finding_id}: its repro line loads {named}; pass that to rerun it", "not rerun:", "yellow")
    return bool(missing)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_rerun_arguments(parser, "triage", "every new one, untriaged")
    parser.add_argument(
        "--jobs",
        type=typed(lambda text: parse_count("--jobs", text)),
        default=1,
        metavar="N",
        help="reruns of one finding run at once (default 1: the switches wait for the rerun as it failed, and "
        "run only where it fails; with more, that rerun starts beside them and their results count only where it "
        "fails; on a GPU host, where compiling is CPU-bound, 7, the rerun and the 6 switches, finishes a finding "
        "fastest)",
    )


def execute(args: argparse.Namespace, console: Console) -> int:
    from kda_conformance.cli import build_parser

    read = store_findings(args, console)
    if read is None:
        return 2
    store, findings = read
    chosen = [f for f in findings if (f.id in args.finding if args.finding else f.status == "new")]
    # Smallest case first: a night's findings range from 37 tokens to 128K, and a triage cut short by its
    # time limit should have separated as many as it could (each finding's page is written as it ends).
    chosen.sort(key=lambda f: Case.from_json(f.case_json).total_tokens if f.case_json else float("inf"))
    unknown = sorted(set(args.finding) - {f.id for f in findings})
    if unknown:
        say(console, f"--finding {', '.join(unknown)}: no such finding in the store", "error:", "red")
        return 2
    setup = rerun_setup(args, store.records, "triage", console)
    if setup is None:
        return 2
    out, env, runs = setup
    parser, results = build_parser(), []
    for finding in chosen:
        if not finding.repro:
            continue
        if plugins_missing(finding.id, finding.repro, args.plugin, parser, console):
            continue
        console.print(f"triage {finding.id}: {finding.backends}, {finding.check}", highlight=False)
        results.append(
            triage(
                finding.id,
                finding.repro,
                parser,
                out,
                env=env,
                plugins=args.plugin,
                jobs=args.jobs,
                timeout=args.rerun_timeout,
            )
        )
        console.print(f"  cause: {results[-1].cause}", highlight=False)
        _save(out, results, runs)
    if not results:  # the pages say so
        _save(out, results, runs)
    console.print(f"triage: {out / 'triage.md'} ({len(results)} findings)", highlight=False)
    return 0


def _save(out: Path, results: list, runs: str) -> None:
    atomic_write_text(out / "triage.md", triage_markdown(results, f"runs {runs}"))
    atomic_write_text(out / "triage.json", triage_json(results))
