"""What a run ran on: device, library versions and the suite's own commit."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import torch

from kda_cases.devices import gpu_arch

_REPO = Path(__file__).resolve().parent.parent


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def suite_commit() -> str:
    """The suite's git commit (with ``+dirty`` for uncommitted changes), or '' outside a checkout.

    A copy without its git folder (a tree shipped to a GPU box) names it in ``KDA_SUITE_COMMIT``.
    """
    if os.environ.get("KDA_SUITE_COMMIT"):
        return os.environ["KDA_SUITE_COMMIT"]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=_REPO, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=_REPO,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{commit}+dirty" if commit and dirty else commit


# Variables that can move a kernel's numbers or choose its code path: Triton's fp32 dot precision
# (TRITON_F32_DEFAULT moves fp32 errors by 100x), its interpreter, FLA's and AITER's switches (FlashKDA's
# segmentation), TF32 overrides, BLAS libraries' settings, the suite's own. Paths and caches are left out:
# they differ between machines without changing a number.
NUMERICS_PREFIXES = (
    "KDA_", "TRITON_", "FLA_", "AITER_", "CHUNK_DELTA_ATTN_", "NVIDIA_TF32", "TORCH_ALLOW_TF32", "CUBLAS",
    "CUDA_LAUNCH_BLOCKING", "ROCBLAS_", "HIPBLASLT_", "MIOPEN_", "OMP_NUM_THREADS",
)  # fmt: skip
NOT_NUMERICS_SUFFIXES = ("_DIR", "_HOME", "_PATH", "_SRC", "_ARTIFACTS", "_CACHE_AUTOTUNING", "_SUITE_COMMIT")


def numerics_variables(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables set that can change a kernel's numbers (NUMERICS_PREFIXES)."""
    environ = dict(os.environ if environ is None else environ)
    return {
        name: value
        for name, value in sorted(environ.items())
        if name.startswith(NUMERICS_PREFIXES) and not name.endswith(NOT_NUMERICS_SUFFIXES)
    }


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict[str, str | int]:
    """A flat description of the machine and libraries, stored beside every record."""
    env: dict[str, str | int] = {
        "device_type": device.type,
        "device_name": cpu_model(),
        "arch": platform.machine(),
        "multiprocessors": 0,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "fla": _version("fla-core"),
        "aiter": _version("aiter"),
        "suite_commit": suite_commit(),
        # Where the commit came from: a copy without its git folder names it in KDA_SUITE_COMMIT.
        "suite_commit_from": "KDA_SUITE_COMMIT" if os.environ.get("KDA_SUITE_COMMIT") else "git",
        "variables": json.dumps(numerics_variables(), sort_keys=True),
        "hostname": platform.node(),
        "date": datetime.now(UTC).isoformat(timespec="milliseconds"),  # orders runs started within a second
    }
    if device.type == "cuda" and torch.cuda.is_available():
        env["visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES") or os.environ.get("HIP_VISIBLE_DEVICES") or ""
        props = torch.cuda.get_device_properties(device)
        env["device_name"] = props.name
        env["multiprocessors"] = props.multi_processor_count
        env["arch"] = gpu_arch(device)
        env["cuda"] = torch.version.cuda or ""
        env["hip"] = torch.version.hip or ""
    return env
