"""Backends by name.

Built-in backends register here. A plugin adds its own without editing this
project: a module that calls :func:`register` when imported, named either by
an entry point in the group ``kda_conformance.backends`` (loaded on first use)
or by ``--kda-plugin MODULE`` (pytest) / ``--plugin MODULE`` (the CLI), where MODULE
is a module's name or the path of its file (or of its package's folder).
See docs/plugins.md.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from kda_cases.case import did_you_mean
from kda_kernels.guard import BackendExit
from kda_kernels.protocol import Backend

ENTRY_POINT_GROUP = "kda_conformance.backends"
# The registered name of the same-precision baseline every limit derives from (kernels/torch_chunk.py).
BASELINE = "torch_chunk"

_FACTORIES: dict[str, Callable[[], Backend]] = {}
# The plugin module each backend came from ("" for the built-in ones and entry points, which load by
# themselves): a repro line names it, so that pasted into a fresh shell it finds the backend.
_PLUGIN_OF: dict[str, str] = {}
_loaded = False
_loading_builtins = False


class PluginError(RuntimeError):
    """A plugin could not be loaded; the message names it."""


def register(name: str, factory: Callable[[], Backend], *, replace: bool = False) -> None:
    """Make ``factory()`` available as backend ``name``."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"backend name {name!r} must be letters, digits, '_' or '-'")
    if name in _FACTORIES and not replace:
        raise ValueError(f"a backend named {name!r} is already registered")
    _FACTORIES[name] = factory
    module = str(getattr(factory, "__module__", "") or "")
    _PLUGIN_OF[name] = "" if _loading_builtins or module.startswith("kda_kernels") else module


def plugin_of(name: str) -> str:
    """The plugin module that registered backend ``name`` ("" for a built-in or entry-point backend)."""
    _load()
    return _PLUGIN_OF.get(name, "")


def code_of(name: str, backend: Backend | None = None) -> str:
    """A short hash of the Python source that defines backend ``name``: the module of its factory, and of its
    class (``backend``, where given) when another module defines that. Records carry it, so a plugin or an
    adapter edited between two runs reads as changed code, not as nondeterminism; the kernel library's own
    code is its version, which records carry apart (``library``). '' where no source file is found."""
    _load()
    factory = _FACTORIES.get(name)
    modules = {getattr(factory, "__module__", None), type(backend).__module__ if backend is not None else None}
    digest = hashlib.sha256()
    found = False
    for module in sorted(m for m in modules if m):
        file = getattr(sys.modules.get(module), "__file__", None)
        if file and Path(file).is_file():
            digest.update(Path(file).read_bytes())
            found = True
    return digest.hexdigest()[:12] if found else ""


def reset() -> None:
    """Forget every backend and plugin, as a fresh process would start (the built-ins load again on use)."""
    global _loaded
    _FACTORIES.clear()
    _PLUGIN_OF.clear()
    _loaded = False


def unregister(name: str) -> None:
    """Forget backend ``name`` (a plugin's tests, which register throwaway backends)."""
    _FACTORIES.pop(name, None)


def _as_path(spec: str) -> Path | None:
    """The file or folder a ``--plugin`` value names, where it is a path rather than a module's name."""
    return Path(spec) if spec.endswith(".py") or "/" in spec or os.sep in spec else None


def plugin_module(spec: str) -> str:
    """The module a ``--plugin`` value loads: a file's stem, a package folder's name, or the value itself."""
    path = _as_path(spec)
    if path is None:
        return spec
    return path.stem if path.suffix == ".py" else path.resolve().name


def _findable(spec: str) -> str:
    """``spec``'s module name, its folder put on sys.path where ``spec`` is a path, or the current
    directory's where the module is no importable name but a file or package there."""
    path = _as_path(spec)
    module = plugin_module(spec)
    if path is None:
        top = module.split(".")[0]
        here = Path.cwd()
        if importlib.util.find_spec(top) is None and ((here / f"{top}.py").is_file() or (here / top).is_dir()):
            sys.path.insert(0, str(here))
        return module
    if not path.exists():
        raise PluginError(f"plugin {spec!r}: no such file or folder")
    if path.is_dir() and not (path / "__init__.py").is_file():
        raise PluginError(f"plugin {spec!r}: a folder without an __init__.py is no package to import")
    file = (path / "__init__.py" if path.is_dir() else path).resolve()
    loaded_from = getattr(sys.modules.get(module), "__file__", None)
    if loaded_from and Path(loaded_from).resolve() != file:
        raise PluginError(f"plugin {spec!r}: another module named {module!r} is imported, from {loaded_from}")
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return module


def load_plugin(spec: str) -> None:
    """Import the plugin ``spec`` names (a module's name, a ``.py`` file's path or a package folder's), which
    registers its backends when imported; whatever goes wrong there (it cannot be found, it raises, it
    registers a name that is taken, it calls sys.exit) is a PluginError naming it."""
    _load()  # the built-in backends first, so that a plugin taking one of their names is told at once
    module = _findable(spec)
    real_exit = os._exit
    os._exit = _exit_at_import  # a plugin that ends the process at import would end it with its code, unseen
    try:
        importlib.import_module(module)
    except BackendExit as exc:
        raise PluginError(f"plugin module {spec!r} called os._exit({exc.code!r}) at import") from None
    except ImportError as exc:
        raise PluginError(f"plugin module {spec!r} cannot be imported: {exc}") from exc
    except SystemExit as exc:
        raise PluginError(f"plugin module {spec!r} called sys.exit({exc.code!r}) at import") from None
    except Exception as exc:
        raise PluginError(f"plugin module {spec!r} raised at import: {type(exc).__name__}: {exc}") from exc
    finally:
        os._exit = real_exit


@functools.cache
def _plainly_importable(module: str) -> bool:
    """Whether a fresh interpreter, started elsewhere without PYTHONPATH (a pasted line's), finds top-level
    ``module`` (an installed package, an editable install): its spec only, nothing imported."""
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 1)"
    try:
        done = subprocess.run([sys.executable, "-E", "-c", probe, module], cwd=tempfile.gettempdir(), timeout=120)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def plugin_argument(module: str) -> str:
    """How ``--plugin`` names ``module`` so that a line pasted into a fresh shell, in any directory, loads
    it: its name where a plain interpreter imports it (an installed package), else the path of its file (or
    its package's folder), found by this process on PYTHONPATH, in its current directory or by a path."""
    file = getattr(sys.modules.get(module), "__file__", None)
    if "." in module or not file or _plainly_importable(module):
        return module
    path = Path(file).resolve()
    return str(path.parent if path.name == "__init__.py" else path)


def _exit_at_import(status: int) -> NoReturn:
    raise BackendExit(status)


def names() -> list[str]:
    _load()
    return sorted(_FACTORIES)


def get(name: str) -> Backend:
    _load()
    if name not in _FACTORIES:
        hint = did_you_mean(name, _FACTORIES)
        raise KeyError(f"unknown backend {name!r}{hint}; known backends: {', '.join(sorted(_FACTORIES))}")
    backend = _FACTORIES[name]()
    # Records, repro lines and the ledger name a backend by its .name: it must be the name it is run by.
    if getattr(backend, "name", None) != name:
        raise PluginError(
            f"backend registered as {name!r} names itself {getattr(backend, 'name', None)!r}: "
            "a backend's .name must be the name it registers under"
        )
    return backend


def _load() -> None:
    global _loaded, _loading_builtins
    if _loaded:
        return
    _loaded = True
    _loading_builtins = True
    try:
        _register_builtins()
    finally:
        _loading_builtins = False


def _register_builtins() -> None:
    from kda_kernels.backends.aiter import BACKENDS as AITER_BACKENDS
    from kda_kernels.backends.fla import FlaChunk, FlaRecurrent
    from kda_kernels.backends.flashkda import FlaChunkDispatch, FlashKdaCuda
    from kda_kernels.backends.vendored import SglangChunk, VllmChunk, VllmGlm5Chunk, VllmGlm5ChunkAmd, VllmKimiChunkAmd
    from kda_kernels.torch_chunk import TorchChunk

    register("fla_chunk", FlaChunk)
    register("fla_chunk32", lambda: FlaChunk(chunk_size=32))
    register("fla_recurrent", FlaRecurrent)
    register(BASELINE, TorchChunk)
    register("flashkda_cuda", FlashKdaCuda)
    register("fla_chunk_dispatch", FlaChunkDispatch)
    register("vllm_chunk", VllmChunk)
    register("vllm_kimi_chunk_amd", VllmKimiChunkAmd)
    register("vllm_glm5_chunk", VllmGlm5Chunk)
    register("vllm_glm5_chunk_amd", VllmGlm5ChunkAmd)
    register("sglang_chunk", SglangChunk)
    for aiter_backend in AITER_BACKENDS:
        register(aiter_backend.name, aiter_backend)
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()
        except Exception as exc:
            raise PluginError(
                f"entry point {entry.name!r} ({entry.value}) of {ENTRY_POINT_GROUP} failed: {exc}"
            ) from exc
