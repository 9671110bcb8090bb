"""The source trees of the servers that vendor FLA's KDA Triton kernels (vLLM's, SGLang's), and how their
kernels are loaded without installing the server (its kernels are Python): ``KDA_VLLM_SRC`` (the folder
holding ``vllm/``) and ``KDA_SGLANG_SRC`` (the folder holding ``sglang/``, i.e. SGLang's ``python/`` folder).
The packages between the tree's root and its ``kda.py`` are registered as bare packages whose ``__init__``
never runs (it would import the whole server), and the few server modules the kernels import from outside
their folder are stubbed with what they use (kernels/server_stubs.py, which a standalone repro file carries
verbatim). A tree whose kernels import anything else is unavailable, and says which module. The backends that
call these kernels as the servers' layers do are kernels/backends/vendored.py.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kda_kernels import server_stubs, triton_interpret
from kda_kernels.protocol import Unsupported


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


class StubGap(Unsupported, server_stubs.StubGap):
    """A stub's gap (kernels/server_stubs.py) as the suite reads it: Unsupported, so a call that meets it is
    a skip naming what is missing, never an error charged to the kernel (:func:`stub_gaps`)."""


@contextlib.contextmanager
def stub_gaps() -> Iterator[None]:
    """Inside, a stub's gap raises as :class:`StubGap`."""
    try:
        yield
    except server_stubs.StubGap as exc:
        if isinstance(exc, StubGap):
            raise
        raise StubGap(str(exc)) from exc


@functools.cache
def load(tree: Tree) -> types.ModuleType:
    """The tree's ``kda`` module (cached: one import per process)."""
    root = tree.root()
    found = [m for m in tree.modules if server_stubs.module_file(root, m) is not None]
    if not found:
        raise VendoredMissing(f"{tree.variable}={root} holds none of {', '.join(tree.modules)}")
    try:
        module = server_stubs.import_kda(root, tree.package, tree.modules, tree.bare)
    except Exception as exc:  # a partial tree, or an import the stubs do not provide: say which
        raise VendoredMissing(f"importing {tree.server}'s {found[0]} failed: {type(exc).__name__}: {exc}") from exc
    if triton_interpret.interpreting():
        triton_interpret.patch_loop_index(tree.package)  # as for FLA: loop indices with .to on a CPU
    return module


def _block_pointer_modules(root: Path) -> list[str]:
    """The loaded modules of the tree at ``root`` whose source calls ``tl.make_block_ptr``, which the CPU
    interpreter of the pinned Triton refuses ("Block pointers have been removed in favor of the tensor
    descriptor API")."""
    root = root.resolve()
    loaded = list(sys.modules.items())
    files = {name: Path(file) for name, module in loaded if (file := getattr(module, "__file__", None))}
    return sorted(
        name.rsplit(".", 1)[-1]
        for name, file in files.items()
        if file.resolve().is_relative_to(root) and "make_block_ptr" in file.read_text(errors="replace")
    )
