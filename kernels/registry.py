"""Backends by name. Built-in ones register here; plugins add theirs with :func:`register`."""

from __future__ import annotations

from collections.abc import Callable

from kda_kernels.protocol import Backend

_FACTORIES: dict[str, Callable[[], Backend]] = {}


def register(name: str, factory: Callable[[], Backend], *, replace: bool = False) -> None:
    """Make ``factory()`` available as backend ``name``."""
    if name in _FACTORIES and not replace:
        raise ValueError(f"a backend named {name!r} is already registered")
    _FACTORIES[name] = factory


def names() -> list[str]:
    _register_builtins()
    return sorted(_FACTORIES)


def get(name: str) -> Backend:
    _register_builtins()
    if name not in _FACTORIES:
        raise KeyError(f"unknown backend {name!r}; known backends: {', '.join(sorted(_FACTORIES))}")
    return _FACTORIES[name]()


_builtins_done = False


def _register_builtins() -> None:
    global _builtins_done
    if _builtins_done:
        return
    _builtins_done = True
    from kda_kernels.fla import FlaChunk, FlaRecurrent

    register("fla_chunk", FlaChunk)
    register("fla_chunk32", lambda: FlaChunk(chunk_size=32))
    register("fla_recurrent", FlaRecurrent)
