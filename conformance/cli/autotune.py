"""``kda-conformance autotune``: the choices autotune made in a warm run, as this GPU model's replay file
(kernels/autotune_replay.py says how replay works)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from kda_conformance.cli.common import say
from kda_conformance.cli.exits import PASSED, USAGE
from kda_kernels import autotune_replay

EXAMPLE = (
    "KDA_AUTOTUNE_RECORD=tuned kda-conformance nightly --store S --device cuda && kda-conformance autotune --from tuned"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--from", dest="parts", type=Path, required=True, metavar="DIR",
        help="the folder a run recorded into (KDA_AUTOTUNE_RECORD=DIR: one autotune-<pid>.json per process)",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=None, metavar="FILE",
        help="the replay file (default: kernels/autotune/<gpu>.json, which the suite replays on that GPU model)",
    )  # fmt: skip
    parser.add_argument(
        "--note", default="", metavar="TEXT",
        help="how the parts were recorded (the runs, the machine), kept in the file's command field "
        "(default: this command line)",
    )  # fmt: skip
    parser.add_argument(
        "--replace", action="store_true",
        help="write only the parts' choices; by default the file's choices for keys the parts did not meet are "
        "kept (when it was recorded on the same GPU model and Triton version)",
    )  # fmt: skip


def execute(args: argparse.Namespace, console: Console) -> int:
    parts = autotune_replay.parts(args.parts)
    if not parts:
        say(
            console,
            f"--from {args.parts}: no autotune-*.json parts (record with KDA_AUTOTUNE_RECORD=DIR)",
            "error:",
            "red",
        )
        return USAGE
    try:
        device, triton, choices = autotune_replay.merge(parts)
    except (ValueError, KeyError) as exc:
        say(console, f"--from {args.parts}: {exc}", "error:", "red")
        return USAGE
    path = args.out or autotune_replay.file_for(device)
    recorded = sum(len(v) for v in choices.values())
    kept = ""
    if path.exists() and not args.replace:
        # One night meets only its own shapes: replacing the file would lose every other night's keys.
        try:
            choices, kept_keys = autotune_replay.keep_earlier(path, device, triton, choices)
        except (ValueError, KeyError) as exc:
            say(console, f"{path}: {exc} (--replace writes the parts' choices alone)", "error:", "red")
            return USAGE
        kept = f", {kept_keys} more kept from the file"
    autotune_replay.write(path, device, triton, choices, args.note or args.command_line)
    console.print(
        f"{recorded} choices of {len(choices)} kernels ({device}, Triton {triton}) from {len(parts)} processes"
        f"{kept}: {path}",
        highlight=False,
    )
    return PASSED
