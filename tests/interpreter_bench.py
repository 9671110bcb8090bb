"""Times pytest tests that run Triton's interpreter, with every workaround and with one left out, side by side.

``python tests/interpreter_bench.py [--leave-out shallow_stack] [--repeats 3] [TEST ...]`` runs the tests
(default: FLA's chunk kernel forward and backward in examples/test_kda_like_fla.py) in a fresh process per run,
the two settings in turn (A B A B ...), and prints each run's wall, user and system seconds, the medians and the
median of the pairs' ratios. A workaround that is only a cost (kernels/triton_interpret.py's ``shallow_stack``)
is kept by these numbers, not by a timed test. Each run calls pytest from this process's own stack depth, as the
test command does.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TESTS = ["examples/test_kda_like_fla.py::test_chunk", "examples/test_kda_like_fla.py::test_chunk_varlen"]


def child(tests: list[str], leave_out: list[str]) -> None:
    """One run: the interpreter switched on without ``leave_out``, then pytest on ``tests`` in this process."""
    from kda_kernels import triton_interpret

    triton_interpret.enable(skip=leave_out)
    import pytest

    start = time.monotonic()
    code = pytest.main([*tests, "-q", "-p", "no:cacheprovider", "-p", "no:randomly"])
    usage = resource.getrusage(resource.RUSAGE_SELF)
    seconds = {"wall": time.monotonic() - start, "user": usage.ru_utime, "system": usage.ru_stime}
    print(json.dumps({"exit": int(code), **seconds}))


def run_once(tests: list[str], leave_out: list[str]) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", *tests, *(f"--leave-out={name}" for name in leave_out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"exit"')]
    if not lines:
        output = done.stdout[-2000:] + done.stderr[-2000:]
        raise SystemExit(f"a run printed no timing (exit {done.returncode}):\n{output}")
    timing = json.loads(lines[-1])
    if timing["exit"] != 0:
        raise SystemExit(f"the tests failed (pytest exit {timing['exit']}) with {leave_out or 'every workaround'}")
    return timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", nargs="*", default=DEFAULT_TESTS, help="pytest node ids (default: %(default)s)")
    parser.add_argument("--leave-out", action="append", default=[], help="the workaround B runs without")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each setting (default: 3)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.tests, args.leave_out)
        return
    leave_out = args.leave_out or ["shallow_stack"]
    runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for _ in range(args.repeats):
        runs["A"].append(run_once(args.tests, []))
        runs["B"].append(run_once(args.tests, leave_out))
    print(f"A: every workaround; B: without {', '.join(leave_out)}; {args.repeats} runs each, A B A B ...")
    for name, measured in runs.items():
        for key in ("wall", "user", "system"):
            values = [run[key] for run in measured]
            listed = " ".join(f"{v:.1f}" for v in values)
            print(f"{name} {key:6} median {statistics.median(values):7.1f} s  ({listed})")
    ratios = [a["wall"] / b["wall"] for a, b in zip(runs["A"], runs["B"], strict=True)]
    print(f"A/B wall, median of the pairs: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
