"""What the suite's tests of itself share: where the repository and the test plugins are, an environment
whose PYTHONPATH finds the plugins, a pytest subprocess in that environment, and a plugin imported for a
while. tests/conftest.py puts this folder on sys.path, so a test imports it by name."""

from __future__ import annotations

import ast
import contextlib
import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "tests" / "plugins"  # backend modules the tests register: planted bugs, crashes, doubles
# glibc's allocator told to keep freed memory under 32 MiB for reuse instead of mapping, zeroing and unmapping
# pages for each tensor: the two detection runs' subprocesses spend most of the test command's CPU time, and the
# suite's tests spent 0.90 of their CPU time with it (whole-process medians, the results journal). Only in the
# subprocesses, whose order of work is fixed: memory handed back stale makes a planted read of torch.empty fail
# in more places, and how often would hang on what the pytest-xdist workers happened to run before. A value the
# caller set wins.
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(16 * 2**30)}
# A subprocess's environment that finds the test plugins by name (``--plugin kda_planted_bugs``).
ENV = {
    **ALLOCATOR,
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH")])),
}


def pytest_run(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``python -m pytest -q --kda-device cpu ARGS`` from the repository, the plugins findable."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "--kda-device", "cpu", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env or ENV, timeout=timeout)


@contextlib.contextmanager
def plugins_on_path() -> Iterator[None]:
    """The test plugins importable by name inside the block, and not after it."""
    sys.path.insert(0, str(PLUGINS))
    try:
        yield
    finally:
        sys.path.remove(str(PLUGINS))


def import_plugin(name: str) -> ModuleType:
    """A test plugin module, imported (its backends registered), the plugin folder left off sys.path."""
    with plugins_on_path():
        return importlib.import_module(name)


def alone_in(folder: Path, source: str, name: str) -> list[str]:
    """A standalone file's ``source`` written as ``folder/name`` (the folder made), and the pytest command that
    runs it there as its maintainer would (in that folder, nothing of the suite's plugins)."""
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(source)
    return [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:randomly", name]


def rel_rms_agrees_with_the_suite(source: str) -> None:
    """A standalone file's ``rms_past_one_ulp`` (the file never imports the suite) gives the suite's rel-RMS
    numerator (``metrics.rms_past_one_ulp``) on one element one ulp off, two ulps off, and an error
    spread over every element, in bf16 and fp32."""
    import math

    import torch

    from kda_conformance.judging.metrics import rms_past_one_ulp

    [helper] = [node for node in ast.parse(source).body if getattr(node, "name", "") == "rms_past_one_ulp"]
    namespace = {"math": math, "torch": torch}
    exec(compile(ast.Module([helper], type_ignores=[]), "<written file>", "exec"), namespace)
    want = torch.linspace(-2.0, 8.1877, 40, dtype=torch.float64)
    for dtype in (torch.bfloat16, torch.float32):
        nearest = want.to(dtype)
        for got in (nearest.clone(), nearest * (1 + 2**-7), nearest.clone().index_fill_(0, torch.tensor([39]), 8.25)):
            err = (got.double() - want).abs()
            ours = rms_past_one_ulp(err, want, dtype)
            theirs = namespace["rms_past_one_ulp"](err, want, dtype)
            assert math.isclose(ours, theirs, rel_tol=1e-12, abs_tol=1e-300), (dtype, ours, theirs)
