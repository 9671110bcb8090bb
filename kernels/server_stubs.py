"""Loading a server's copy of the KDA kernels from its source tree without installing the server: the
packages between the tree's root and its ``kda.py`` registered bare (their ``__init__`` would import the whole
server), and the few server modules the kernels import from outside their folder stubbed with what they use
(``STUBS``).

It imports nothing of kda-conformance: a standalone repro file for a server's kernels
(conformance/repro/standalone_finding.py) carries this module verbatim, so that its maintainer can run it on
a source checkout as the suite does. The suite's side (which trees exist, their environment variables, the
interpreter) is kernels/vendored_trees.py.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch


class StubGap(AttributeError):
    """The kernels asked a stub of the server's modules for something the loader does not provide: the
    loader's gap, not the kernel's error. An AttributeError, so ``hasattr`` and ``from m import x`` behave as
    they would."""


class _Stub(types.ModuleType):
    """A stub module of the server: what the loader provides, and a StubGap naming anything else."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        raise StubGap(f"the stub of {self.__name__} has no {name} (the loader's gap, not the kernel's)")


def _triton_utils() -> dict[str, object]:
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    return {"triton": triton, "tl": tl, "tldevice": tldevice, "HAS_TRITON": True}


def _math_utils() -> dict[str, object]:
    return {
        "cdiv": lambda a, b: -(a // -b),
        "next_power_of_2": lambda n: 1 << (int(n) - 1).bit_length() if n > 0 else 1,
        # vLLM's own constant (vllm/utils/math_utils.py), not 1 / ln 2: its gates' log2 scaling uses it.
        "RCP_LN2": 1.4426950216,
    }


class _Capability(tuple):
    """vLLM's ``DeviceCapability``: ``(major, minor)`` that compares as a tuple and says ``to_int()``."""

    @property
    def major(self) -> int:
        return self[0]

    @property
    def minor(self) -> int:
        return self[1]

    def to_int(self) -> int:
        return self[0] * 10 + self[1]

    def as_version_str(self) -> str:
        return f"{self[0]}.{self[1]}"


class _Platform:
    """What the kernels ask of vLLM's ``current_platform`` (vllm/platforms/interface.py); anything else is a
    StubGap naming it."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        raise StubGap(f"the stub of vllm.platforms.current_platform has no {name} (the loader's gap)")

    def get_device_capability(self, device_id: int = 0) -> _Capability | None:
        if not torch.cuda.is_available():
            return None
        return _Capability(torch.cuda.get_device_capability(device_id))

    def has_device_capability(self, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        current = self.get_device_capability(device_id)
        if current is None:
            return False
        return tuple(current) >= tuple(capability) if isinstance(capability, tuple) else current.to_int() >= capability

    def is_device_capability(self, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        current = self.get_device_capability(device_id)
        if current is None:
            return False
        return tuple(current) == tuple(capability) if isinstance(capability, tuple) else current.to_int() == capability

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        current = self.get_device_capability(device_id)
        return current is not None and current.to_int() // 10 == capability // 10

    def is_arch_support_pdl(self) -> bool:
        return False  # programmatic dependent launch: a scheduling choice, not the kernels' numerics

    def get_device_name(self, device_id: int = 0) -> str:
        return torch.cuda.get_device_name(device_id) if torch.cuda.is_available() else "cpu"

    def num_compute_units(self, device_id: int = 0) -> int:
        return torch.cuda.get_device_properties(device_id).multi_processor_count

    def is_cuda_alike(self) -> bool:
        return torch.cuda.is_available()

    def is_cuda(self) -> bool:
        return torch.cuda.is_available() and torch.version.hip is None

    def is_rocm(self) -> bool:
        return torch.cuda.is_available() and torch.version.hip is not None

    def is_xpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return not torch.cuda.is_available()


def _async_tensor_h2d(
    data: object,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM's host-to-device copy of host-built metadata (its chunk indices), without the pinned staging."""
    host = torch.as_tensor(data, dtype=dtype or (out.dtype if out is not None else None))
    if out is not None:
        return out.copy_(host, non_blocking=True)
    return host.to(device=device, non_blocking=True)


class _CustomOp(torch.nn.Module):
    """vLLM's ``CustomOp``: only its ``register`` decorator is used by the kernel files."""

    @classmethod
    def register(cls, name: str) -> Callable[[type], type]:
        return lambda op: op


def _sglang_utils() -> dict[str, object]:
    platform = _Platform()
    return {
        **{k: v for k, v in _math_utils().items() if k != "RCP_LN2"},
        "is_cpu": platform.is_cpu,
        "is_cuda": platform.is_cuda,
        "is_hip": platform.is_rocm,
        "is_npu": lambda: False,
        "cpu_has_amx_support": lambda: False,
        "torch_release": tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]),
    }


# Modules outside the kernels' folder that they import, and what is provided in their place.
STUBS: dict[str, Callable[[], dict[str, object]]] = {
    "vllm.triton_utils": _triton_utils,
    "vllm.utils.math_utils": _math_utils,
    "vllm.platforms": lambda: {"current_platform": _Platform()},
    "vllm.model_executor.custom_op": lambda: {"CustomOp": _CustomOp},
    "vllm.utils.gpu_sync_debug": lambda: {"gpu_sync_allowed": contextlib.nullcontext},
    "vllm.utils.torch_utils": lambda: {"async_tensor_h2d": _async_tensor_h2d},
    "vllm.utils.platform_utils": lambda: {"num_compute_units": _Platform().num_compute_units},
    "sglang.srt.utils": _sglang_utils,
    "sglang.srt.utils.common": _sglang_utils,
    # SGLang 0.5.23's gated norm asks for the JIT's CUDA arch and programmatic dependent launch: neither here
    "sglang.kernels.jit.utils": lambda: {
        "get_jit_cuda_arch": lambda *a, **k: None,
        "is_arch_support_pdl": lambda *a, **k: False,
    },
}


def module_file(root: Path, module: str) -> Path | None:
    """Where ``module`` lives in the tree (a file, or a package's ``__init__.py``), or None."""
    path = root.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _register_parents(root: Path, dotted: str) -> None:
    """Every package above ``dotted``, bare (its ``__init__`` never runs: it would import the whole server),
    where not registered already."""
    parts = dotted.split(".")[:-1]
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*parts[:depth]))]
            sys.modules[name] = package


def register_tree(root: Path, package: str, modules: tuple[str, ...], bare: tuple[str, ...] = ()) -> None:
    """Bare packages from the tree's root down to each kernel folder it may have (``modules``: one copy may
    import another's modules) and to each of ``bare``, and the stubs of the server whose top package is
    ``package``."""
    for module in modules:
        _register_parents(root, module)
    for name in bare:
        _register_parents(root, f"{name}.x")  # the package itself, bare, with its parents
    for name, provide in STUBS.items():
        if name.split(".")[0] != package or name in sys.modules:
            continue
        _register_parents(root, name)
        stub = _Stub(name)
        stub.__dict__.update(provide())
        stub.__path__ = []  # a package too, in case the kernels import a submodule of it
        sys.modules[name] = stub


def import_kda(root: Path, package: str, modules: tuple[str, ...], bare: tuple[str, ...] = ()) -> types.ModuleType:
    """The first of ``modules`` (where the server's ``kda.py`` lives, newest layout first) that the tree at
    ``root`` holds, imported with its packages bare and the server's modules stubbed (:func:`register_tree`).
    ImportError where the tree holds none of them."""
    found = [m for m in modules if module_file(root, m) is not None]
    if not found:
        raise ImportError(f"{root} holds none of {', '.join(modules)}")
    register_tree(root, package, modules, bare)
    return importlib.import_module(found[0])
