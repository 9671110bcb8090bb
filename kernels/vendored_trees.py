"""The source trees of the servers that vendor FLA's KDA Triton kernels (vLLM's, SGLang's), and how their
kernels are loaded without installing the server (its kernels are Python): ``KDA_VLLM_SRC`` (the folder
holding ``vllm/``) and ``KDA_SGLANG_SRC`` (the folder holding ``sglang/``, i.e. SGLang's ``python/`` folder).
The packages between the tree's root and its ``kda.py`` are registered as bare packages whose ``__init__``
never runs (it would import the whole server), and the few server modules the kernels import from outside
their folder are stubbed with what they use (``STUBS``). A tree whose kernels import anything else is
unavailable, and says which module. The backends that call these kernels as the servers' layers do are
kernels/backends/vendored.py.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kda_kernels import triton_interpret
from kda_kernels.protocol import (
    Unsupported,
)


class VendoredMissing(RuntimeError):
    """The server's kernels cannot be loaded here; the message says why."""


@dataclass(frozen=True)
class Tree:
    """Where a server keeps its copy of the KDA kernels and what it needs from outside that folder."""

    server: str  # "vLLM"
    variable: str  # the environment variable naming the source tree
    package: str  # the top package in the tree
    modules: tuple[str, ...]  # where kda.py lives, newest layout first
    # Packages of the tree the kernels import from, registered bare too (their __init__ imports the server).
    bare: tuple[str, ...] = ()

    def root(self) -> Path:
        source = os.environ.get(self.variable)
        if not source:
            raise VendoredMissing(
                f"{self.variable} names no {self.server} source tree (the folder holding {self.package}/)"
            )
        root = Path(source)
        if not (root / self.package).is_dir():
            raise VendoredMissing(f"{self.variable}={source} holds no {self.package}/ folder")
        return root


# vLLM's copy of FLA the model folders' kernels build on: its package __init__ imports every FLA op (and
# vLLM's JIT warm-up machinery), so it is registered bare and its modules import one by one.
VLLM_FLA = ("vllm.third_party.flash_linear_attention.ops",)
VLLM = Tree(
    "vLLM",
    "KDA_VLLM_SRC",
    "vllm",
    (
        # vLLM 0.33's Kimi layer imports NVIDIA's own copy on CUDA (AMD's on ROCm), which builds on the next one
        "vllm.models.kimi_k3.nvidia.ops.third_party.kda",
        "vllm.third_party.flash_linear_attention.ops.kda",
        "vllm.model_executor.layers.fla.ops.kda",
    ),
    VLLM_FLA,
)
VLLM_KIMI_AMD = Tree("vLLM", "KDA_VLLM_SRC", "vllm", ("vllm.models.kimi_k3.amd.ops.third_party.kda",), VLLM_FLA)
# GLM-5.3-Flash (vllm/models/glm5next): its layer imports chunk_kda_with_fused_gate from the NVIDIA copy's
# kernels module on CUDA and from the AMD copy's on ROCm (glm5next/common/kda.py).
VLLM_GLM5 = Tree("vLLM", "KDA_VLLM_SRC", "vllm", ("vllm.models.glm5next.nvidia.ops.third_party.kda.kernels",), VLLM_FLA)
VLLM_GLM5_AMD = Tree(
    "vLLM", "KDA_VLLM_SRC", "vllm", ("vllm.models.glm5next.amd.ops.third_party.kda.kernels",), VLLM_FLA
)
SGLANG = Tree(
    "SGLang",
    "KDA_SGLANG_SRC",
    "sglang",
    ("sglang.kernels.ops.attention.fla.kda", "sglang.srt.layers.attention.fla.kda"),
)
TREES = (VLLM, VLLM_KIMI_AMD, VLLM_GLM5, VLLM_GLM5_AMD, SGLANG)


class StubGap(Unsupported, AttributeError):
    """The kernels asked a stub of the server's modules for something the loader does not provide: the
    suite's gap, not the kernel's error. An AttributeError (so ``hasattr`` and ``from m import x`` behave as
    they would) and Unsupported (so a call that meets it is a skip naming what is missing, never an error
    charged to the kernel)."""


class _Stub(types.ModuleType):
    """A stub module of the server: what the loader provides, and a StubGap naming anything else."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        raise StubGap(f"the suite's stub of {self.__name__} has no {name} (the loader's gap, not the kernel's)")


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
        raise StubGap(f"the suite's stub of vllm.platforms.current_platform has no {name} (the loader's gap)")

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


def _async_tensor_h2d(data: object, device: object = None, dtype: object = None, out: object = None) -> torch.Tensor:
    """vLLM's host-to-device copy of host-built metadata (its chunk indices), without the pinned staging."""
    host = torch.as_tensor(data, dtype=dtype or (out.dtype if isinstance(out, torch.Tensor) else None))
    if isinstance(out, torch.Tensor):
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


def _module_file(root: Path, module: str) -> Path | None:
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


def _register_tree(tree: Tree, root: Path) -> None:
    """Bare packages from the tree's root down to each kernel folder it may have (one copy may import
    another's modules), and the stubs of ``tree``'s server."""
    for module in tree.modules:
        _register_parents(root, module)
    for package in tree.bare:
        _register_parents(root, f"{package}.x")  # the package itself, bare, with its parents
    for name, provide in STUBS.items():
        if name.split(".")[0] != tree.package or name in sys.modules:
            continue
        _register_parents(root, name)
        stub = _Stub(name)
        stub.__dict__.update(provide())
        stub.__path__ = []  # a package too, in case the kernels import a submodule of it
        sys.modules[name] = stub


@functools.cache
def load(tree: Tree) -> types.ModuleType:
    """The tree's ``kda`` module (cached: one import per process)."""
    root = tree.root()
    found = [m for m in tree.modules if _module_file(root, m) is not None]
    if not found:
        raise VendoredMissing(f"{tree.variable}={root} holds none of {', '.join(tree.modules)}")
    _register_tree(tree, root)
    try:
        module = importlib.import_module(found[0])
        if triton_interpret.interpreting():
            triton_interpret.patch_loop_index(tree.package)  # as for FLA: loop indices with .to on a CPU
        return module
    except Exception as exc:  # a partial tree, or an import the stubs do not provide: say which
        raise VendoredMissing(f"importing {tree.server}'s {found[0]} failed: {type(exc).__name__}: {exc}") from exc


def _block_pointer_modules(root: Path) -> list[str]:
    """The loaded modules of the tree at ``root`` whose source calls ``tl.make_block_ptr``, which the CPU
    interpreter of the pinned Triton refuses ("Block pointers have been removed in favor of the tensor
    descriptor API")."""
    root = root.resolve()
    return sorted(
        name.rsplit(".", 1)[-1]
        for name, module in list(sys.modules.items())
        if getattr(module, "__file__", None)
        and Path(module.__file__).resolve().is_relative_to(root)
        and "make_block_ptr" in Path(module.__file__).read_text(errors="replace")
    )
