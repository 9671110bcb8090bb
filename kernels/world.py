"""What a backend's call may not change of the process it shares with the suite and the other backends,
taken before each call and put back after it (kernels/guard.py charges each change to the backend).

A run computes many backends in one process, on inputs drawn under one case id. A backend that leaves
torch's default dtype float64 changes how every later case is drawn (limits 2.4x tighter, a correct backend
failed); one that sets ``KDA_REFERENCE_FORM`` switches the truth's form; one that replaces the suite's
reference or baseline function loosens every later limit; one that writes the float64 truth it can reach
(``gc.get_objects()``) passes itself and fails the next backend. So each call is taken in a clean world:

- torch's settings (precision switches old and new, grad and autocast modes, ...), the working directory,
  the recursion limit and the SIGINT and SIGTERM handlers (:data:`SETTINGS`), torch's function- and
  dispatch-mode stacks, the torch callables the suite computes with (:data:`TORCH_HOLDERS`: a wrapped
  ``torch.matmul`` moved the baseline 1.9e3 times its limit), the standard streams and file descriptors
  0-2, and ``os.environ``: a change is put back and is the backend's failure,
  except the environment variables the backend declares it sets (``Backend.sets_environment``: a library
  that switches itself on by a variable at import), and the ones torch sets itself the first time a part
  of it is used (:data:`TORCH_VARIABLES`), whoever's call that is. The suite's own variables (``KDA_*``) no
  backend may set. Only the standard file descriptors are held: any other may be closed at any moment by
  the garbage collector finalising a file object nobody holds, inside a call or not (seen: the suite's
  "closed file descriptor 17" charged to a backend that touched no file).
- the suite's own definitions (the functions and classes of its five packages, and the methods of its
  classes): one replaced is put back and is the backend's failure.
- suite state a backend can reach but is not handed (the truths a run holds): watchers the suite registers
  (:func:`add_watcher`) prove it unchanged after each call that runs the kernel, put it back where it changed
  and say what. Not after a question the backend answers (its envelope, supports, fit, availability): half a
  run's calls are questions, and a proof of every truth held after each was a sixth of the ``ci`` controls'
  time. A change a question made is found after the next call, the kernel's, and charged to it.
- torch's global random generators: put back quietly, then moved on one step where the call drew from them.
  Not a failure: the suite draws every input from generators of its own (cases/materialize.py), so a
  backend's draws change no one's verdict, and a backend that adds random noise still sees fresh noise on
  each call (its repeats differ, as the determinism check must see).
"""

from __future__ import annotations

import contextlib
import io
import operator
import os
import signal
import sys
import threading
import types
from collections.abc import Callable, Collection, Mapping
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


def _flag(path: str) -> tuple[str, Callable[[], object], Callable[[object], None]]:
    """One of torch's older boolean switches (``torch.backends.cudnn.allow_tf32``, ...)."""
    *holder_path, key = path.split(".")
    holder: object = torch
    for part in holder_path[1:]:
        holder = getattr(holder, part)
    return path, lambda: getattr(holder, key), lambda value: setattr(holder, key, value)


def _autocast(device: str) -> tuple[str, Callable[[], object], Callable[[object], None]]:
    return (
        f"torch's {device} autocast",
        lambda: torch.is_autocast_enabled(device),
        lambda on: torch.set_autocast_enabled(device, on),
    )


# A setting's name (as a message says it), its getter and its setter.
SETTINGS: tuple[tuple[str, Callable[[], object], Callable[[object], None]], ...] = (
    *_precision_switches(),
    *(
        _flag(path)
        for path in (
            "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
            "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
            "torch.backends.cudnn.allow_tf32",
            "torch.backends.cudnn.benchmark",
            "torch.backends.cudnn.deterministic",
        )
    ),
    ("torch's grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
    *(_autocast(device) for device in ("cpu", "cuda")),
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
# Settings a thread left running by an earlier call may change between two calls, proven and put back before
# the next call starts (the rest the suite itself moves between calls: pytest swaps the standard streams,
# a test changes directory).
BETWEEN_CALLS = frozenset(name for name, _, _ in SETTINGS) - {"the working directory"}
SUITE_VARIABLES = "KDA_"  # the suite's own settings (the truth's form, the profile, strict mode, ...)
SUITE_PACKAGES = ("kda_cases", "kda_reference", "kda_kernels", "kda_reports", "kda_conformance")
# Set by torch itself, when unset, the first time a part of it is used, in whichever call that happens:
# inductor's cache folder (torch._inductor's cache_dir(), reached through the torch.compiler.disable that
# FLA 0.6.0 and the servers' copies of its kernels wrap their entry points in: on an H200 every FLA backend
# was charged with it on its first call, docs/results/) and CUDA's lazy module loading (set at CUDA's
# initialization). They are the process's: a first setting is kept and charged to no one; a change of a
# value already there is still the backend's.
TORCH_VARIABLES = frozenset({"TORCHINDUCTOR_CACHE_DIR", "CUDA_MODULE_LOADING"})
DECLARE = "a backend that sets it on purpose declares it in sets_environment (docs/plugins.md)"

_MEMBERS = (types.FunctionType, classmethod, staticmethod, property)


@dataclass(frozen=True)
class Holder:
    """A module or class holding some of the suite's definitions: its keys there, their dotted names, and a
    getter of their values from its namespace in one C call (a look binding by binding, two per call over
    some 2,000 bindings, was an eighth of the ``ci`` controls' run)."""

    holder: object
    keys: tuple[str, ...]
    names: tuple[str, ...]
    get: Callable[[Mapping[str, object]], object]

    def values(self) -> tuple[object, ...]:
        space = vars(self.holder)
        try:
            got = self.get(space)
        except KeyError:  # a definition a call deleted: None where it is gone
            return tuple(space.get(key) for key in self.keys)
        return got if len(self.keys) > 1 else (got,)


# Found again only when sys.modules grows or shrinks: a scan costs 1.3 ms, a look well under 0.1 ms.
_holders: list[Holder] = []
_holders_of = -1  # len(sys.modules) when they were found


def _ours(value: object) -> bool:
    module = getattr(value, "__module__", None) or ""
    return module.split(".")[0] in SUITE_PACKAGES


def _find_holders() -> list[Holder]:
    """The suite's functions and classes, by where they are bound (module-level and class members)."""
    found: dict[int, tuple[object, list[str], list[str]]] = {}

    def bound(holder: object, key: str, name: str) -> None:
        _, keys, names = found.setdefault(id(holder), (holder, [], []))
        keys.append(key)
        names.append(name)

    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.split(".")[0] not in SUITE_PACKAGES:
            continue
        for name, value in list(vars(module).items()):
            if not (isinstance(value, (types.FunctionType, type)) and _ours(value)):
                continue  # a cache, a counter, a third-party function held: not a definition
            bound(module, name, f"{module_name}.{name}")
            if isinstance(value, type) and value.__module__ == module_name:
                for member, item in list(vars(value).items()):
                    if isinstance(item, _MEMBERS):
                        bound(value, member, f"{module_name}.{name}.{member}")
    return [Holder(h, tuple(keys), tuple(names), operator.itemgetter(*keys)) for h, keys, names in found.values()]


def _definitions() -> list[tuple[Holder, tuple[object, ...]]]:
    global _holders, _holders_of
    if len(sys.modules) != _holders_of:
        _holders, _holders_of = _find_holders(), len(sys.modules)
    return [(holder, holder.values()) for holder in _holders]


# Where the torch callables the suite computes with are bound (the reference's and the baseline's
# torch.matmul, F.normalize, torch.linalg.solve_triangular, the Tensor methods). torch.Tensor is held whole:
# a method set on it shadows torch._C.TensorBase's (which cannot be set); in the others a name added is no
# one's business, a callable replaced or removed is.
TORCH_HOLDERS: tuple[tuple[str, object], ...] = (
    ("torch.Tensor", torch.Tensor),
    ("torch", torch),
    ("torch.nn.functional", torch.nn.functional),
    ("torch.linalg", torch.linalg),
)


def _torch_callables() -> dict[str, dict[str, object]]:
    """Each holder's namespace as it is (a C-speed copy: compared whole first, name by name only if it moved)."""
    return {label: dict(vars(holder)) for label, holder in TORCH_HOLDERS}


def _counts(label: str, value: object) -> bool:
    """Whether a name bound to ``value`` is one the suite computes with: a function (torch rebinds classes
    itself: ``set_default_dtype`` moves ``torch.Storage``)."""
    return label == "torch.Tensor" or (callable(value) and not isinstance(value, (type, types.ModuleType)))


# torch's mode stacks (thread-local, as a call runs in one thread): a TorchFunctionMode or
# TorchDispatchMode entered and left open sees every later torch call, the suite's arithmetic included.
MODE_STACKS = (
    ("function", torch._C._len_torch_function_stack, torch._C._get_function_stack_at,
     torch._C._pop_torch_function_stack, torch._C._push_on_torch_function_stack),
    ("dispatch", torch._C._len_torch_dispatch_stack, torch._C._get_dispatch_stack_at,
     lambda: torch._C._pop_torch_dispatch_stack(None), torch._C._push_on_torch_dispatch_stack),
)  # fmt: skip


def _modes() -> dict[str, tuple[object, ...]]:
    return {kind: tuple(at(i) for i in range(length())) for kind, length, at, _, _ in MODE_STACKS}


STREAMS = {"stdin": 0, "stdout": 1, "stderr": 2}  # each with its file descriptor
STANDARD_FDS = {0: "standard input", 1: "standard output", 2: "standard error"}


def _streams() -> dict[str, tuple[object, bool]]:
    return {name: (getattr(sys, name), bool(getattr(getattr(sys, name), "closed", False))) for name in STREAMS}


def _identity(fd: int) -> tuple[int, int] | None:
    """What a file descriptor points at (device, inode), None where it is closed."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _standard_fds() -> dict[int, tuple[int, int]]:
    found = {fd: _identity(fd) for fd in STANDARD_FDS}
    return {fd: ident for fd, ident in found.items() if ident is not None}


# A copy (dup) of each standard file descriptor as it was when a call last started, to put back one a call
# closed or pointed elsewhere; taken again only when the descriptor itself moved (pytest's capture).
_std_copies: dict[int, int] = {}


def _keep_standard_fds(fds: dict[int, tuple[int, int]]) -> None:
    for fd in STANDARD_FDS:
        kept = _std_copies.get(fd)
        if fd not in fds or (kept is not None and _identity(kept) == fds[fd]):
            continue
        if kept is not None:
            with contextlib.suppress(OSError):
                os.close(kept)
        with contextlib.suppress(OSError):
            _std_copies[fd] = os.dup(fd)


@dataclass
class World:
    """The world as a call found it."""

    settings: dict[str, object]
    environment: dict[str, str]
    definitions: list[tuple[Holder, tuple[object, ...]]]
    rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    torch_callables: dict[str, dict[str, object]]
    modes: dict[str, tuple[object, ...]]
    streams: dict[str, tuple[object, bool]]
    fds: dict[int, tuple[int, int]]


def _read(get: Callable[[], object]) -> object:
    try:
        return get()
    except Exception as exc:  # a getter a call broke (torch's legacy precision after a mix of its two APIs)
        return f"<unreadable: {type(exc).__name__}>"


def take() -> World:
    cuda = torch.cuda.is_initialized()
    fds = _standard_fds()
    _keep_standard_fds(fds)
    return World(
        {name: _read(get) for name, get, _ in SETTINGS},
        dict(os.environ),
        _definitions(),
        torch.get_rng_state(),
        torch.cuda.get_rng_state_all() if cuda else None,
        _torch_callables(),
        _modes(),
        _streams(),
        fds,
    )


# Suite state outside the process's globals that a call could reach: each watcher, asked after every call,
# proves it unchanged or puts it back, and says what had changed (an empty list: nothing).
_watchers: list[Callable[[], list[str]]] = []


def add_watcher(watcher: Callable[[], list[str]]) -> None:
    _watchers.append(watcher)


def put_back(
    before: World, declared: Collection[str] = (), between_calls: bool = False, watched: bool = True
) -> list[str]:
    """Restore what a call changed of ``before``; each change, as what the backend did (its name goes first).
    ``declared``: the environment variables the backend may set (kept as it left them). ``watched``: the
    watchers prove what they watch (not after a question). ``between_calls``:
    ``before`` is the world as the last call left it, proven before the next starts (a thread left running
    changed it): what the suite itself moves between calls is not compared (see :data:`BETWEEN_CALLS`)."""
    changes = put_torch_back(before)  # first: a mode left open stands between torch and its getters
    changes += _put_settings_back(before.settings, BETWEEN_CALLS if between_calls else None)
    changes += _put_environment_back(before.environment, {name for name in declared if not _suite(name)})
    changes += _put_definitions_back(before.definitions)
    if not between_calls:
        changes += _put_streams_back(before.streams)
        changes += _put_fds_back(before.fds)
        _put_random_back(before)
    for watcher in list(_watchers) if watched else []:
        try:
            changes += watcher()
        except Exception:  # a device the call left dead: nothing more runs on it, the call's error stands
            break
    return changes


def _suite(variable: str) -> bool:
    return variable.startswith(SUITE_VARIABLES)


def put_torch_back(before: World) -> list[str]:
    """torch's mode stacks and the callables the suite computes with, as ``before``: done first after a
    call (the guard's own comparisons of the inputs compute with torch)."""
    return _put_modes_back(before.modes) + _put_torch_back(before.torch_callables)


def _put_settings_back(before: dict[str, object], only: Collection[str] | None = None) -> list[str]:
    changes = []
    for name, get, put in SETTINGS:
        if only is not None and name not in only:
            continue
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


def _put_definitions_back(before: list[tuple[Holder, tuple[object, ...]]]) -> list[str]:
    changes = []
    for holder, values in before:
        now = holder.values()
        if all(map(operator.is_, now, values)):  # identity, never ==: a replacement may say it equals anything
            continue
        for key, where, value, current in zip(holder.keys, holder.names, values, now, strict=True):
            if current is not value:
                setattr(holder.holder, key, value)
                changes.append(f"replaced the suite's {where} (put back)")
    return changes


def _same(a: dict[str, object], b: dict[str, object]) -> bool:
    try:
        return a == b  # identity first, value by value: the common case, no change, costs microseconds
    except Exception:  # a value whose == is not a bool (a tensor bound in a namespace that changed)
        return False


_TORCH_DIR = os.path.dirname(torch.__file__)


def _torchs_own(value: object) -> bool:
    """A callable torch itself binds on the first use of a part of it (torch._dynamo, imported by the
    ``torch.compiler.disable`` FLA wraps its entry points in, rebinds ``torch.manual_seed`` to a wrapper of
    its own): the process's, kept and charged to no one, like :data:`TORCH_VARIABLES`."""
    code = getattr(value, "__code__", None)
    return isinstance(code, types.CodeType) and os.path.abspath(code.co_filename).startswith(_TORCH_DIR + os.sep)


def _put_torch_back(before: dict[str, dict[str, object]]) -> list[str]:
    changes = []
    for label, holder in TORCH_HOLDERS:
        now = dict(vars(holder))
        if _same(now, before[label]):
            continue
        for key, value in before[label].items():
            if key in now and _torchs_own(now[key]):
                continue
            if now.get(key) is not value and _counts(label, value):
                setattr(holder, key, value)
                what = "replaced" if key in now else "removed"
                changes.append(f"{what} {label}.{key}, which the suite computes with (put back)")
        for key in now.keys() - before[label].keys():
            if label == "torch.Tensor" and not _torchs_own(now[key]):  # shadows torch._C.TensorBase's
                delattr(holder, key)
                changes.append(f"set torch.Tensor.{key}, which the suite computes with (removed)")
    return changes


def _put_modes_back(before: dict[str, tuple[object, ...]]) -> list[str]:
    changes = []
    for kind, length, at, pop, push in MODE_STACKS:
        now = tuple(at(i) for i in range(length()))
        if len(now) == len(before[kind]) and all(a is b for a, b in zip(now, before[kind], strict=True)):
            continue
        while length():
            pop()
        for mode in before[kind]:
            push(mode)
        left = [type(mode).__name__ for mode in now if not any(mode is m for m in before[kind])]
        what = f"left {', '.join(left)} on torch's {kind}-mode stack" if left else f"changed torch's {kind}-mode stack"
        changes.append(f"{what}: every later torch call would go through it (put back)")
    return changes


def _reopened(name: str, stream: object) -> io.TextIOWrapper:
    """A fresh text stream on the standard file descriptor ``stream`` wrote to, in its manner."""
    return open(  # the process's stream from now on, never closed here
        STREAMS[name],
        "r" if name == "stdin" else "w",
        encoding=getattr(stream, "encoding", None) or "utf-8",
        errors=getattr(stream, "errors", None) or "backslashreplace",
        buffering=1 if getattr(stream, "line_buffering", False) else -1,
        closefd=False,
    )


def _put_streams_back(before: dict[str, tuple[object, bool]]) -> list[str]:
    changes = []
    for name, (stream, was_closed) in before.items():
        now = getattr(sys, name)
        closed = bool(getattr(stream, "closed", False))
        if now is stream and closed == was_closed:
            continue
        if closed and not was_closed:
            setattr(sys, name, _reopened(name, stream))
            changes.append(f"closed sys.{name} (a fresh one on its file descriptor put in its place)")
        else:
            setattr(sys, name, stream)
            changes.append(f"replaced sys.{name} (put back)")
    return changes


def _put_fds_back(before: dict[int, tuple[int, int]]) -> list[str]:
    changes = []
    for fd, ident in before.items():
        if _identity(fd) == ident:
            continue
        what = "closed" if _identity(fd) is None else "pointed elsewhere"
        kept = _std_copies.get(fd)
        if kept is not None and _identity(kept) == ident:
            os.dup2(kept, fd)
            changes.append(f"{what} file descriptor {fd} ({STANDARD_FDS[fd]}; put back)")
        else:
            changes.append(f"{what} file descriptor {fd} ({STANDARD_FDS[fd]}; not put back: no copy of it kept)")
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
