"""What a run ran on: device, library versions and the suite's own commit."""

from __future__ import annotations

import importlib.metadata
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


def environment(device: torch.device) -> dict[str, str | int]:
    """A flat description of the machine and libraries, stored beside every record."""
    env: dict[str, str | int] = {
        "device_type": device.type,
        "device_name": platform.processor() or platform.machine(),
        "arch": platform.machine(),
        "multiprocessors": 0,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "fla": _version("fla-core"),
        "aiter": _version("aiter"),
        "suite_commit": suite_commit(),
        "hostname": platform.node(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
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
