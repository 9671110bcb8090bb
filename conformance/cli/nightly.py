"""``kda-conformance nightly``: the nightly profile into a store, then the store's dashboard (one command)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from kda_cases.profiles import PROFILES
from kda_conformance.cli import run
from kda_conformance.cli.common import add_backends, add_device, add_isolation, add_reference_form, add_regressions

NAME = "nightly"
HELP = "the nightly job: the nightly profile into a store, then the dashboard (one command)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", type=Path, required=True, help="the run store (a folder kept between nights)")
    add_device(parser)
    add_backends(parser)
    parser.add_argument("--profile", choices=list(PROFILES), default="nightly", help="sweep profile (default: nightly)")
    parser.add_argument("--examples", type=int, default=None, help="cases to draw (default: the profile's)")
    parser.add_argument("--seed", type=int, default=None, help="the draw's seed (default: a fresh one, recorded)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each record as it is measured")
    add_isolation(parser)
    add_regressions(parser)
    add_reference_form(parser)


def execute(args: argparse.Namespace, console: Console) -> int:
    args.out, args.cases, args.dashboard = args.store, None, True
    return run.execute(args, console)
