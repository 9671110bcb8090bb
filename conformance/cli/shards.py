"""``kda-conformance shards``: what each backend's tests cost in a measured night, as this GPU model's cost
file, and how a night of N shards would share its tests by it (conformance/running/shards.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from kda_conformance.cli.common import add_out, say
from kda_conformance.cli.exits import PASSED, USAGE
from kda_conformance.running import shards
from kda_kernels.autotune_replay import gpu_slug
from kda_reports.runfile import read_object, run_files

EXAMPLE = "kda-conformance shards --store /srv/kda-store --run-id night-a --count 4"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_out(parser, required=True)
    parser.add_argument("--run-id", required=True, help="the measured night (every part of it: shards and workers)")
    parser.add_argument(
        "--count", type=int, default=4, metavar="N", help="print how N shards would share that night (default: 4)"
    )
    parser.add_argument(
        "--write", nargs="?", const="default", default=None, metavar="FILE",
        help="write the cost file (default place: conformance/running/shard_costs/<gpu>.json, which "
        "--shard reads on that GPU model)",
    )  # fmt: skip
    parser.add_argument(
        "--note", default="", metavar="TEXT",
        help="how the night was run, kept in the file's command field (default: this command line)",
    )  # fmt: skip


def execute(args: argparse.Namespace, console: Console) -> int:
    if args.count < 1:
        say(console, f"--count must be 1 or more, got {args.count}", "error:", "red")
        return USAGE
    files = run_files(Path(args.out), args.run_id)
    timing = [p for p in files if p.name.endswith(".timing.json")]
    problems: list[str] = []
    tests = shards.run_tests(timing, problems)
    for line in problems:
        say(console, line, "warning:", "yellow")
    if not tests:
        say(
            console,
            f"--run-id {args.run_id}: no test seconds in {args.out}/runs (a pytest run of this suite "
            "keeps them in its timing.json; older runs did not)",
            "error:",
            "red",
        )
        return USAGE
    environments = [read_object(p) or {} for p in files if p.name.endswith(".env.json")]
    names = (env.get("device_name") for env in environments if env.get("device_type") == "cuda")
    device = next((name for name in names if isinstance(name, str) and name), "")
    seconds = shards.backend_seconds(tests)
    costs = shards.Costs(seconds, f"run {args.run_id}")
    plan = shards.plan(sorted(tests), args.count, costs)
    console.print(f"{len(tests)} tests, {sum(seconds.values()):.0f} s over {len(seconds)} backends", highlight=False)
    for name, value in sorted(seconds.items(), key=lambda item: -item[1]):
        console.print(f"  {name:<28} {value:8.0f} s", highlight=False)
    for index in range(1, args.count + 1):
        console.print(plan.line(index), highlight=False, soft_wrap=True)
    if args.write is not None:
        if args.write == "default" and not device:
            say(console, "--write: the run was not on a GPU; name the file (--write FILE)", "error:", "red")
            return USAGE
        path = shards.FOLDER / f"{gpu_slug(device)}.json" if args.write == "default" else Path(args.write)
        shards.write(path, device, args.run_id, seconds, len(tests), args.note or args.command_line)
        console.print(f"cost file: {path}", highlight=False)
    return PASSED
