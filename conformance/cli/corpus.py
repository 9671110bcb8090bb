"""``kda-conformance corpus``: list the pinned cases, or pin a case or every failing case of a run."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from kda_cases.case import Case
from kda_cases.corpus import CORPUS_DIR, load_corpus, save_case
from kda_conformance.cli.common import parse_case, say, typed
from kda_reports.runfile import read_run

EXAMPLE = 'kda-conformance corpus add --from-run out/runs/RUN_ID.parquet --why "seen in the nightly"'


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="corpus_command")
    parser.set_defaults(corpus_help=parser.format_help)  # no subcommand: the help, not a bare argparse error
    sub.add_parser("list", help="print the pinned cases")
    add = sub.add_parser("add", help="pin a case, or every failing case of a run file")
    add.add_argument("--case", type=typed(parse_case), default=None, metavar="JSON_OR_FILE", help="the case to pin")
    add.add_argument("--from-run", type=Path, default=None, metavar="RUN_FILE", help="pin the run's failing cases")
    add.add_argument("--why", default="", help="why the case matters (stored with it)")
    add.add_argument("--dir", type=Path, default=CORPUS_DIR, help="corpus folder (default: cases/corpus)")


def execute(args: argparse.Namespace, console: Console) -> int:
    if args.corpus_command is None:
        console.print(args.corpus_help(), highlight=False, markup=False)
        return 0
    if args.corpus_command == "list":
        for entry in load_corpus():
            say(console, f"{entry.case.id}  {entry.case.label}  {entry.why}")
        return 0
    if (args.case is None) == (args.from_run is None):
        say(console, "corpus add takes exactly one of --case and --from-run", "error:", "red")
        return 2
    if args.case is not None:
        found = [(args.case, args.why or "added by hand")]
    else:
        try:
            frame = read_run(args.from_run)
        except (OSError, ValueError) as exc:
            say(console, f"--from-run: {exc}", "error:", "red")
            return 2
        bad = frame[frame["verdict"].isin(["fail", "error"])].drop_duplicates("case_id")
        why = args.why or f"failed in run {frame['run_id'].iloc[0] if len(frame) else '?'}"
        found = [
            (Case.from_json(text), f"{why}: {backend} {tensor or 'raised'}")
            for text, backend, tensor in zip(bad["case_json"], bad["backend"], bad["tensor"], strict=True)
        ]
    if args.dir == CORPUS_DIR and {"site-packages", "dist-packages"} & set(CORPUS_DIR.parts):
        say(
            console,
            f"the default corpus folder lies in the installed package ({CORPUS_DIR}): pin into your checkout's "
            "cases/corpus with --dir, or install the suite editable (pip install -e)",
            "error:",
            "red",
        )
        return 2
    for case, why in found:
        path, new = save_case(case, why, args.dir)
        console.print(f"{'added' if new else 'already pinned'}: {path.name} ({case.label})", highlight=False)
    if not found:
        console.print("no failing cases in that run")
    return 0
