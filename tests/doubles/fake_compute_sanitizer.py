"""A stand-in for NVIDIA's compute-sanitizer (tests/test_sanitize.py): it takes the options the suite passes, runs
the command after them, then writes the report of FAKE_SANITIZER_REPORT (a file) to its --log-file, with %p
replaced by its own pid, and exits as the command did; where FAKE_SANITIZER_NOTE_REPLAY names a file, it writes there
the KDA_AUTOTUNE_REPLAY it was given. Not the tool: it instruments nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TAKES_A_VALUE = {"--tool", "--target-processes", "--print-limit", "--log-file"}


def main(argv: list[str]) -> int:
    options, i = {}, 0
    while i < len(argv) and argv[i].startswith("--"):
        options[argv[i]] = argv[i + 1] if argv[i] in TAKES_A_VALUE else ""
        i += 2 if argv[i] in TAKES_A_VALUE else 1
    code = subprocess.call(argv[i:])
    noted = os.environ.get("FAKE_SANITIZER_NOTE_REPLAY")
    if noted:  # what the rerun was told to replay (tests/test_sanitize.py)
        Path(noted).write_text(os.environ.get("KDA_AUTOTUNE_REPLAY", ""))
    report = Path(os.environ["FAKE_SANITIZER_REPORT"]).read_text()
    log = options.get("--log-file")
    text = report.replace("TOOL", options.get("--tool", "memcheck"))
    if log:
        Path(log.replace("%p", str(os.getpid()))).write_text(text)
    else:
        sys.stdout.write(text)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
