"""What a backend's call may not change of the process it shares with the suite and the other backends,
taken before each call and put back after it (kernels/guard.py charges each change to the backend).

A run computes many backends in one process, on inputs drawn under one case id. A backend that leaves
torch's default dtype float64 changes how every later case is drawn (limits 2.4x tighter, a correct backend
failed); one that sets ``KDA_REFERENCE_FORM`` switches the truth's form; one that replaces the suite's
reference or baseline function loosens every later limit; one that writes the float64 truth it can reach
(``gc.get_objects()``) passes itself and fails the next backend. So each call is taken in a clean world:

- torch's settings, the working directory, the recursion limit and the SIGINT and SIGTERM handlers
  (:data:`SETTINGS`), and ``os.environ``: a change is put back and is the backend's failure,
  except the environment variables the backend declares it sets (``Backend.sets_environment``: a library
  that switches itself on by a variable at import), and the ones torch sets itself the first time a part
  of it is used (:data:`TORCH_VARIABLES`), whoever's call that is. The suite's own variables (``KDA_*``) no
  backend may set.
- the suite's own definitions (the functions and classes of its five packages, and the methods of its
  classes): one replaced is put back and is the backend's failure.
- suite state a backend can reach but is not handed (the truths a run holds): watchers the suite registers
  (:func:`add_watcher`) prove it unchanged after each call, put it back where it changed and say what.
- torch's global random generators: put back quietly, then moved on one step where the call drew from them.
  Not a failure: the suite draws every input from generators of its own (cases/materialize.py), so a
  backend's draws change no one's verdict, and a backend that adds random noise still sees fresh noise on
  each call (its repeats differ, as the determinism check must see).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import types
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch


def _precision_switches() -> list[tuple[str, Callable[[], object], Callable[[object], None]]]:
    """torch's newer per-backend float32 precision switches (``torch.backends.mkldnn.matmul.fp32_precision``,
    ...), where this torch has them. One set to "bf16" or "tf32" makes the legacy getter raise for everyone
    after (a mix of the two APIs), so they are put back before it."""
    switches = []
    for path in ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv",
                 "mkldnn.rnn"):  # fmt: skip
        holder: object = torch.backends
        for part in filter(None, path.split(".")):
            holder = getattr(holder, part, None)
        if holder is None or not hasattr(holder, "fp32_precision"):
            continue
        name = f"torch.backends{'.' + path if path else ''}.fp32_precision"
        switches.append(
            (name, lambda h=holder: h.fp32_precision, lambda value, h=holder: setattr(h, "fp32_precision", value))
        )
    return switches


def _set_signal(signum: int, handler: object) -> None:
    if threading.current_thread() is threading.main_thread():  # only the main thread may set a handler
        signal.signal(signum, handler)


# A setting's name (as a message says it), its getter and its setter.
SETTINGS: tuple[tuple[str, Callable[[], object], Callable[[object], None]], ...] = (
    *_precision_switches(),
    ("torch's default dtype", torch.get_default_dtype, torch.set_default_dtype),
    ("torch's default device", torch.get_default_device, torch.set_default_device),
    ("torch's float32 matmul precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    ("torch's deterministic mode", torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms),
    ("torch's thread count", torch.get_num_threads, torch.set_num_threads),
    ("the working directory", os.getcwd, os.chdir),  # the run's relative paths (its store) would move with it
    ("the recursion limit", sys.getrecursionlimit, sys.setrecursionlimit),
    *(
        (f"the handler of {sig.name}", lambda s=sig: signal.getsignal(s), lambda h, s=sig: _set_signal(s, h))
        for sig in (signal.SIGINT, signal.SIGTERM)  # a run that could no longer be stopped
    ),
)
SUITE_VARIABLES = "KDA_"  # the suite's own settings (the truth's form, the profile, strict mode, ...)
SUITE_PACKAGES = ("kda_cases", "kda_reference", "kda_kernels", "kda_reports", "kda_conformance")
# Set by torch itself, when unset, the first time a part of it is used, in whichever call that happens:
# inductor's cache folder (torch._inductor's cache_dir(), reached through the torch.compiler.disable that
# FLA 0.6.0 and the servers' copies of its kernels wrap their entry points in: on the H200 on 2026-12-04
# every FLA backend was charged with it on its first call) and CUDA's lazy module loading (set at CUDA's
# initialization). They are the process's: a first setting is kept and charged to no one; a change of a
# value already there is still the backend's.
TORCH_VARIABLES = frozenset({"TORCHINDUCTOR_CACHE_DIR", "CUDA_MODULE_LOADING"})
DECLARE = "a backend that sets it on purpose declares it in sets_environment (docs/plugins.md)"

_MEMBERS = (types.FunctionType, classmethod, staticmethod, property)
# Where each of the suite's definitions is bound: its dotted name, the module or class holding it, and its
# key there. Found again only when sys.modules grows or shrinks: a scan costs 1.3 ms, a look 0.1 ms.
Binding = tuple[str, object, str]
_bindings: list[Binding] = []
_bindings_of = -1  # len(sys.modules) when they were found


def _ours(value: object) -> bool:
    module = getattr(value, "__module__", None) or ""
    return module.split(".")[0] in SUITE_PACKAGES


def _find_bindings() -> list[Binding]:
    """The suite's functions and classes, by where they are bound (module-level and class members)."""
    found: list[Binding] = []
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.split(".")[0] not in SUITE_PACKAGES:
            continue
        for name, value in list(vars(module).items()):
            if not (isinstance(value, (types.FunctionType, type)) and _ours(value)):
                continue  # a cache, a counter, a third-party function held: not a definition
            found.append((f"{module_name}.{name}", module, name))
            if isinstance(value, type) and value.__module__ == module_name:
                members = vars(value).items()
                found += [(f"{module_name}.{name}.{m}", value, m) for m, item in members if isinstance(item, _MEMBERS)]
    return found


def _definitions() -> list[tuple[Binding, object]]:
    global _bindings, _bindings_of
    if len(sys.modules) != _bindings_of:
        _bindings, _bindings_of = _find_bindings(), len(sys.modules)
    return [(binding, vars(binding[1]).get(binding[2])) for binding in _bindings]


@dataclass
class World:
    """The world as a call found it."""

    settings: dict[str, object]
    environment: dict[str, str]
    definitions: list[tuple[Binding, object]]
    rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None


def _read(get: Callable[[], object]) -> object:
    try:
        return get()
    except Exception as exc:  # a getter a call broke (torch's legacy precision after a mix of its two APIs)
        return f"<unreadable: {type(exc).__name__}>"


def take() -> World:
    cuda = torch.cuda.is_initialized()
    return World(
        {name: _read(get) for name, get, _ in SETTINGS},
        dict(os.environ),
        _definitions(),
        torch.get_rng_state(),
        torch.cuda.get_rng_state_all() if cuda else None,
    )


# Suite state outside the process's globals that a call could reach: each watcher, asked after every call,
# proves it unchanged or puts it back, and says what had changed (an empty list: nothing).
_watchers: list[Callable[[], list[str]]] = []


def add_watcher(watcher: Callable[[], list[str]]) -> None:
    _watchers.append(watcher)


def put_back(before: World, declared: Collection[str] = ()) -> list[str]:
    """Restore what a call changed of ``before``; each change, as what the backend did (its name goes first).
    ``declared``: the environment variables the backend may set (kept as it left them)."""
    changes = _put_settings_back(before.settings)
    changes += _put_environment_back(before.environment, {name for name in declared if not _suite(name)})
    changes += _put_definitions_back(before.definitions)
    _put_random_back(before)
    for watcher in list(_watchers):
        try:
            changes += watcher()
        except Exception:  # a device the call left dead: nothing more runs on it, the call's error stands
            break
    return changes


def _suite(variable: str) -> bool:
    return variable.startswith(SUITE_VARIABLES)


def _put_settings_back(before: dict[str, object]) -> list[str]:
    changes = []
    for name, get, put in SETTINGS:
        now = _read(get)
        if now != before[name]:
            try:
                put(before[name])
            except Exception as exc:  # the suite's own state it cannot restore: said, never raised
                changes.append(f"changed {name} from {before[name]!r} to {now!r} (not put back: {exc})")
                continue
            changes.append(f"changed {name} from {before[name]!r} to {now!r} (put back)")
    return changes


def _put_environment_back(before: dict[str, str], declared: set[str]) -> list[str]:
    """Values are not quoted: an environment variable may hold a credential."""
    after = dict(os.environ)
    changes = []
    for name in sorted(before.keys() | after.keys()):
        if before.get(name) == after.get(name) or name in declared:
            continue
        if name in TORCH_VARIABLES and name not in before:  # torch's first use of its cache, not a choice
            continue
        whose = f"the suite's variable {name}" if _suite(name) else f"the environment variable {name}"
        if name not in before:
            del os.environ[name]
            what = f"set {whose} (removed)"
        else:
            os.environ[name] = before[name]
            what = f"{'changed' if name in after else 'removed'} {whose} (put back)"
        changes.append(what if _suite(name) else f"{what}; {DECLARE}")
    return changes


def _put_definitions_back(before: list[tuple[Binding, object]]) -> list[str]:
    changes = []
    for (where, holder, key), value in before:
        if vars(holder).get(key) is not value:
            setattr(holder, key, value)
            changes.append(f"replaced the suite's {where} (put back)")
    return changes


def _put_random_back(before: World) -> None:
    if not torch.equal(torch.get_rng_state(), before.rng):
        torch.set_rng_state(before.rng)
        torch.rand(1)  # one step on: the next call's draws are fresh, and none of them this call's
    if before.cuda_rng is None:
        return
    now = torch.cuda.get_rng_state_all()
    if any(not torch.equal(a, b) for a, b in zip(now, before.cuda_rng, strict=False)):
        torch.cuda.set_rng_state_all(before.cuda_rng)
        for generator in torch.cuda.default_generators:  # one step on, without a kernel launch
            generator.set_offset(generator.get_offset() + 4)
