"""Device helpers every layer shares: which device a name means, its GPU architecture, a synchronize."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """``auto`` picks the GPU when torch sees one, else the CPU; a GPU asked for but absent is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ValueError(f"device={name!r} is not allowed; choose auto, cpu, cuda or cuda:N")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was asked for but torch sees no GPU")
    return device


def gpu_arch(device: torch.device) -> str:
    """``gfx950``, ``gfx942``, ``sm_90``...: the GPU's architecture (AMD's without its feature suffixes),
    or "" for a CPU or when no GPU is visible."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return ""
    props = torch.cuda.get_device_properties(device)
    amd = getattr(props, "gcnArchName", "")
    return amd.split(":")[0] if amd else f"sm_{props.major}{props.minor}"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so its time and its faults land where it was launched."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
