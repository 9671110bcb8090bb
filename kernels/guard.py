"""The contract of every backend call, checked at every call: the suite's inputs are the suite's, an output
is an output, and a backend does not end the process.

A run shares one case's inputs between its backends (the float64 truth and the baseline are computed once
per case). A backend that writes into them (``q``, ``initial_state``, ``cu_seqlens``, ...) would pass
itself and make the next backend fail. So every call here keeps a bitwise copy of what it hands over,
compares after the call, puts the inputs back where they changed, and notes a breach naming what the
backend wrote (the tensor and its first changed element; :func:`take_breaches`); the call goes on. The
tensors themselves are handed, not copies: a server reuses its buffers from call to call (a kernel caching
on a tensor's identity is a bug only that shows). Where a call leaves a thread running
(kernels/left_work.py), the copies of what it was handed are kept while the thread lives, and a later
write into them is put back and charged to it, before any other call starts or is judged. The
same holds for a state pool a paged backend is given: it may write the slots its call names (the
sequences' and the checkpoints'), nothing else. A result that is not a :class:`BackendOutput` of tensors
on the inputs' device, or a returned tensor that shares memory with an input or with another returned
tensor, ends the call with a BackendFault. ``os._exit`` and ``SystemExit`` inside a call end the call,
not the process; a child the backend forks inside the call is the backend's and ends with it.

Any exception a backend's own code raises leaves marked with the backend's name (:func:`raised_by`), so
whoever catches it charges it to the backend and not to the suite code around the call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from kda_cases.case import Case
from kda_cases.dtypes import bits
from kda_cases.envelope import Envelope
from kda_cases.guards import bands, extent, memory_of
from kda_cases.materialize import KDAInputs
from kda_kernels import autotune_replay, left_work
from kda_kernels.protocol import Backend, BackendOutput, Support, Unsupported
from kda_kernels.world import World, put_back, put_torch_back, take

TOKEN_INPUTS = ("q", "k", "v", "g", "beta")  # [B, T, heads, ...]
INPUT_TENSORS = (*TOKEN_INPUTS, "A_log", "dt_bias", "initial_state", "cu_seqlens")
OUTPUT_TENSORS = ("o", "final_state", "checkpoint_states")


class BackendFault(Exception):
    """A backend broke its call's contract. ``verdict`` is ``fail`` where it did something to memory the
    suite can point at (``tensor``, ``index``: the first changed element, or the pool ``slot``), ``error``
    where it gave no output at all (a wrong return, an attempt to end the process)."""

    def __init__(
        self, reason: str, tensor: str = "", index: tuple[int, ...] | None = None, slot: int | None = None
    ) -> None:
        super().__init__(reason)
        self.reason, self.tensor, self.index, self.slot = reason, tensor, index, slot
        self.verdict = "fail" if (index is not None or slot is not None) else "error"
        self.late = False  # found after its call, in another's (a thread it left running did it)


class BackendExit(BaseException):
    """``os._exit`` called by a backend inside a call: a BaseException, so the backend's own
    ``except Exception`` does not swallow it."""

    def __init__(self, code: object) -> None:
        super().__init__(code)
        self.code = code


def exception_text(exc: BaseException) -> str:
    """``str(exc)``, which a backend's exception may make raise: then a sentence saying so, so that the
    exception is still charged to whoever raised it."""
    try:
        return str(exc)
    except Exception as inner:
        return f"<its message could not be read: str() raised {type(inner).__name__}>"


def raised_by(exc: BaseException) -> str | None:
    """The backend whose own code raised ``exc`` (None: raised by the suite's code)."""
    return getattr(exc, "kda_backend", None)


NO_EXIT = "a backend may not end the process"


def fault(backend: Backend, what: str, case: Case | None = None, **where: object) -> BackendFault:
    """A BackendFault charged to ``backend``: ``what`` it did (its name goes first), ``where`` in memory."""
    broken = BackendFault(f"{backend.name} {what}", **where)
    broken.case = case
    _charge(broken, backend)
    return broken


def _charge(exc: BaseException, backend: Backend) -> None:
    if raised_by(exc) is None:
        try:
            exc.kda_backend = backend.name
        except AttributeError:  # an exception type without a __dict__: the message still names the backend
            pass


# Listeners told of each call's start and end (the run journals the call in flight, so a process that dies
# inside a backend leaves a record naming it).
_listeners: list[Callable[[str, Backend], None]] = []


def add_listener(listener: Callable[[str, Backend], None]) -> None:
    """``listener("call", backend)`` before each guarded call, ``listener("returned", backend)`` after."""
    _listeners.append(listener)


def remove_listener(listener: Callable[[str, Backend], None]) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


@contextlib.contextmanager
def suite_work(backend: Backend) -> Iterator[None]:
    """The suite's own code inside a backend's call (an adapter checking what the kernel wrote around its
    output): listeners hear ``suite`` before it and ``kernel`` after it, so what is observed of the call
    (its device-to-host syncs) is the kernel's and the server code the adapter models, not the suite's."""
    for listener in list(_listeners):
        listener("suite", backend)
    try:
        yield
    finally:
        for listener in list(_listeners):
            listener("kernel", backend)


_depth: dict[int, int] = {}  # guarded calls in progress per thread (a paged call may run a plain one inside)


def _put_world_back(backend: Backend, before: World, question: bool = False) -> None:
    """Restore what the call changed of the process (kernels/world.py), each change the backend's failure;
    while threads an earlier call left running are alive, theirs instead (:func:`_late`). ``put_back`` is
    bound here at import: a backend that replaces the world's has it put back by the real one."""
    declared = getattr(backend, "sets_environment", ())
    declared = tuple(declared) if isinstance(declared, (tuple, list, set, frozenset)) else ()
    changes = put_back(before, [name for name in declared if isinstance(name, str)], watched=not question)
    others = [owner for owner in left_work.owners() if owner is not backend]
    for what in changes:
        if others:
            _late(others, what, f"found after {backend.name}'s call, which may have done it itself")
        else:
            _breach(backend, what)


def _breach(backend: Backend, what: str) -> None:
    """Note that the call did ``what`` to what it must leave as it was (put back already): its failure."""
    broken = fault(backend, what)
    broken.verdict = "fail"
    _breaches.append(broken)


def _late(owners: list, what: str, when: str) -> None:
    """``what`` was done while threads the ``owners`` left running were alive: each owner's failure."""
    for owner in owners:
        _breach(owner, f"{what}, after its call had returned: a thread it left running was alive ({when})")
        _breaches[-1].late = True


# The world as the last call left it, while threads a call left running live: proven before the next call.
_settled: World | None = None


def _prove_world_between_calls() -> World | None:
    """What threads left running changed of the world since the last call: put back to the world that call
    left, charged to their backends; that world (None where no thread was left running)."""
    global _settled
    settled, _settled = _settled, None
    owners = left_work.owners()
    if not owners or settled is None:
        return None
    for what in put_back(settled, between_calls=True):
        _late(owners, what, "found before the next call")
    return settled


def _forget(ended: list[threading.Thread]) -> None:
    """Forget the left threads that had ended before the proof (one ending during it is proved next time),
    and what the calls of backends with none left alive were handed."""
    left_work.forget(ended)
    alive = left_work.owners()
    _kept[:] = [kept for kept in _kept if any(kept[0] is owner for owner in alive)]


# Whether a signal (Ctrl-C, a time limit's SIGTERM) reached this process: a KeyboardInterrupt inside a call
# without one is the backend's own doing, an error of its call, not the user stopping the run.
_signalled = threading.Event()


def note_signal() -> None:
    """Say that a signal is about to raise KeyboardInterrupt in this process (the suite's handlers do)."""
    _signalled.set()


def _signal_handler(signum: int, frame: object) -> None:
    note_signal()
    signal.default_int_handler(signum, frame)


def _watch_ctrl_c() -> None:
    """Ctrl-C as Python's default handler takes it, noted first (where that handler is still the one set)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is (
        signal.default_int_handler
    ):
        signal.signal(signal.SIGINT, _signal_handler)


def _trapped_exit(code: int) -> None:
    if _depth.get(threading.get_ident()):
        raise BackendExit(code)
    left_work.real_exit(code)


def _forked_in_a_call() -> None:
    """In a child a backend forked (``os.fork``, ``multiprocessing``): the child is the backend's, not the
    suite. It carries no exit trap (its ``os._exit`` ends it), tells no listener (it writes no journal row)
    and owns no call, so a child that returns from the call ends there (:func:`_end_forked_child`) instead
    of carrying on as a second copy of the sweep."""
    if not _depth:
        return
    _depth.clear()
    _listeners.clear()
    _breaches.clear()
    os._exit = left_work.real_exit


os.register_at_fork(after_in_child=_forked_in_a_call)


def _end_forked_child(exc: BaseException | None) -> None:
    """End a forked child that left the backend's call (returning or raising), with the code it would have."""
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    else:
        code = 0 if exc is None else 1
    left_work.flush_and_exit(code)


@contextlib.contextmanager
def _in_call(
    backend: Backend,
    tensors: Mapping[str, torch.Tensor] | None = None,
    keep: tuple[str, ...] = (),
    question: bool = False,
) -> Iterator[Snapshot | None]:
    """The backend's call: listeners told, ``os._exit`` and ``SystemExit`` turned into a fault of the call,
    every exception marked as the backend's. Yields the snapshot of the ``tensors`` handed over, taken after
    what threads earlier calls left running did is put back. After the call, the tensors proved unchanged
    (put back, a breach where the call returned; ``keep``: the ones it may write), then the world
    (kernels/world.py): in that order, so a truth made again is made from the suite's inputs. ``question``: the
    call answers a question (envelope, supports, fit, availability), after which the truths are not proved."""
    global _settled
    _watch_ctrl_c()
    thread = threading.get_ident()
    outermost = not _depth.get(thread)
    ended = left_work.ended() if outermost else []
    if outermost and left_work.owners():  # before the snapshot: the inputs as the suite made them
        _check_kept("found before the next call")
    handed = Snapshot.of(tensors) if tensors is not None else None
    for listener in list(_listeners):
        listener("call", backend)
    before = None
    if outermost:  # the outermost call of this thread takes the world, proved just before
        settled = _prove_world_between_calls()
        before = take()
        if settled is not None:  # the settled settings, whatever a left thread set since the proof: its change
            before.settings = dict(settled.settings)
        _forget(ended)
    work = left_work.running() if outermost else None
    _depth[thread] = _depth.get(thread, 0) + 1
    os._exit = _trapped_exit
    process = os.getpid()
    returned = False
    try:
        try:
            yield handed
        except BaseException as exc:
            if os.getpid() != process:
                _end_forked_child(exc)
            raise
        if os.getpid() != process:
            _end_forked_child(None)
        returned = True
    except Unsupported:
        raise
    except BackendExit as exc:
        raise fault(backend, f"called os._exit({exc.code!r}) during its call: {NO_EXIT}") from None
    except SystemExit as exc:
        raise fault(backend, f"raised SystemExit({exc.code!r}) during its call: {NO_EXIT}") from None
    except KeyboardInterrupt:
        if _signalled.is_set():
            raise
        said = "raised KeyboardInterrupt during its call with no interrupt sent to the process"
        raise fault(backend, f"{said}: {NO_EXIT}") from None
    except Exception as exc:
        _charge(exc, backend)
        raise
    finally:
        if before is not None:  # before the suite computes anything itself (a mode left open sees it all)
            for what in put_torch_back(before):
                _breach(backend, what)
        _depth[thread] -= 1
        if not _depth[thread]:
            del _depth[thread]
        if not _depth:
            os._exit = left_work.real_exit
        for listener in list(_listeners):
            listener("returned", backend)
        left = left_work.started_since(work) if work is not None else None  # what ends in the grace is the call's
        theirs: tuple[str, ...] = ()
        if outermost and any(owner is not backend for owner in left_work.owners()):
            _check_kept(f"found after {backend.name}'s call, which may have done it itself")
            theirs = _held_by_others(backend, handed) if handed is not None else ()
        if handed is not None and returned:
            _check_unchanged(backend, handed, (*keep, *theirs))
        elif handed is not None:
            handed.put_back(skip=keep)  # the backend's exception stands; what it was handed is as it was
        if before is not None:  # after "returned": the suite's own proof (the truths watched) is not the call's
            _put_world_back(backend, before, question)
        if left:
            _breach(backend, left_work.described(left))
            left_work.leave(left, backend)
            if handed is not None:
                _kept[:] = [*_kept[1 - KEPT_CALLS :], (backend, handed, keep)]
        if outermost and left_work.owners():  # the settings as this call began: none a thread set since
            _settled = dataclasses.replace(take(), settings=dict(before.settings))


def _answer(backend: Backend, question: str, ask: Callable[[], object], case: Case | None) -> object:
    """A question to the backend that must be answered, never raised (Backend's contract)."""
    try:
        with _in_call(backend, question=True):
            return ask()
    except BackendFault as broken:
        broken.case = case
        raise
    except Exception as exc:
        said = f"raised {type(exc).__name__} in {question}: {exception_text(exc)} (it must answer, never raise)"
        raise fault(backend, said, case) from exc


def availability(backend: Backend, device: torch.device) -> Support:
    """Whether its envelope runs on ``device``'s type, then ``backend.availability(device)``; a BackendFault
    where either raises."""

    def ask() -> Support:
        devices = backend.envelope.devices
        if device.type not in devices:
            return Support.no(f"{backend.name} runs on {' and '.join(devices)} only (its envelope), not {device.type}")
        return backend.availability(device)

    return _answer(backend, "availability", ask, None)


def supports(backend: Backend, case: Case) -> Support:
    """``backend.supports(case)``; a BackendFault (naming the case) where it raises."""
    return _answer(backend, "supports", lambda: backend.supports(case), case)


def envelope(backend: Backend) -> Envelope:
    """``backend.envelope``; a BackendFault where reading it raises or gives no Envelope."""
    declared = _answer(backend, "envelope", lambda: backend.envelope, None)
    if not isinstance(declared, Envelope):
        raise fault(backend, f"declares {type(declared).__name__} as its envelope, not an Envelope")
    return declared


def fit(backend: Backend, case: Case) -> Case:
    """``backend.fit(case)``; a BackendFault (naming the case) where it raises or returns no Case."""
    fitted = _answer(backend, "fit", lambda: backend.fit(case), case)
    if not isinstance(fitted, Case):
        raise fault(backend, f"returned {type(fitted).__name__} from fit, not a Case", case)
    return fitted


def input_tensors(inputs: KDAInputs) -> dict[str, torch.Tensor]:
    """Every tensor of ``inputs`` a backend may read and must not write, by name."""
    named = {name: getattr(inputs, name) for name in INPUT_TENSORS if getattr(inputs, name) is not None}
    for key, value in (inputs.host_metadata or {}).items():
        if isinstance(value, torch.Tensor):
            named[f"host_metadata[{key!r}]"] = value
    return named


@dataclass
class Snapshot:
    """Tensors handed to a backend and what each must still hold after the call, bit for bit."""

    tensors: Mapping[str, torch.Tensor]  # as handed
    copies: dict[str, torch.Tensor]  # what they held
    # The memory around each tensor (its guard bands, cases/guards.py), as it was: nobody's to write.
    around: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> Snapshot:
        copies = {name: t.detach().clone() for name, t in tensors.items()}
        return cls(tensors, copies, {name: bands(t) for name, t in tensors.items()})

    def band_change(self, name: str) -> bool:
        """Whether the memory around tensor ``name`` changed (a write past its end or before its start)."""
        if name not in self.around:
            return False
        now = bands(self.tensors[name])
        return now.shape != self.around[name].shape or not torch.equal(bits(now), bits(self.around[name]))

    def restore_bands(self, name: str) -> None:
        x, saved = self.tensors[name], self.around[name]
        memory, (first, end) = memory_of(x), extent(x)
        with torch.no_grad():
            if saved.numel() == first + memory.numel() - end:
                memory[:first].copy_(saved[:first])
                memory[end:].copy_(saved[first:])

    def first_change(self, name: str) -> tuple[int, ...] | None:
        now, before = self.tensors[name], self.copies[name]
        if now.shape != before.shape or now.dtype != before.dtype:
            return ()
        differs = bits(now) != bits(before)
        return tuple(differs.nonzero()[0].tolist()) if bool(differs.any()) else None

    def put_back(self, skip: tuple[str, ...] = ()) -> None:
        """Every changed tensor put back, quietly (the call already failed for another reason)."""
        for name in self.tensors:
            if name in skip:
                continue
            try:
                if self.first_change(name) is not None:
                    self.restore(name)
            except Exception:  # a dead device context: nothing more can run here anyway
                return

    def restore(self, name: str) -> None:
        """Put a changed tensor back, so later calls (other backends on the same case) get the suite's inputs."""
        with torch.no_grad():
            if self.tensors[name].shape == self.copies[name].shape:
                self.tensors[name].copy_(self.copies[name])


def _value(x: torch.Tensor, index: tuple[int, ...]) -> str:
    return str(x[index].item()) if index and x.dim() == len(index) else "?"


# Contract breaks a call survived (the inputs put back): taken by whoever runs the check (take_breaches),
# which adds them to the check's findings. The call itself goes on, so the check's own verdicts still come.
_breaches: list[BackendFault] = []


def take_breaches() -> list[BackendFault]:
    """The contract breaks seen since the last call of this function (each names its backend)."""
    taken = list(_breaches)
    _breaches.clear()
    return taken


def _check_unchanged(backend: Backend, snapshot: Snapshot, skip: tuple[str, ...] = (), late: str = "") -> None:
    """Note a breach for every input tensor the backend wrote (its first changed element), and put it back.
    ``late``: when it was found, where a thread the backend left running wrote after its call returned."""
    after_return = f", after its call had returned: a thread it left running was alive ({late})" if late else ""
    for name in snapshot.tensors:
        if name in skip:
            continue
        where = snapshot.first_change(name)
        if where is None:
            continue
        before, after = _value(snapshot.copies[name], where), _value(snapshot.tensors[name], where)
        at = f"first changed element {list(where)} ({before} -> {after})" if where else "its shape or dtype changed"
        what = f"wrote into its input {name}{after_return}: {at}"
        _breaches.append(fault(backend, what, tensor=name, index=where))
        _breaches[-1].late = bool(late)
        snapshot.restore(name)
    for name in snapshot.around:
        if name not in skip and snapshot.band_change(name):
            what = f"wrote into the memory around its input {name} (the guard band past its end or before its start)"
            _breaches.append(fault(backend, what + after_return, tensor=name, index=()))
            _breaches[-1].late = bool(late)
            snapshot.restore_bands(name)


# What calls that left threads running were handed (their copies kept to compare), while those threads live:
# the last KEPT_CALLS calls' (a backend that leaves a thread on every call would otherwise hold every case).
_kept: list[tuple[Backend, Snapshot, tuple[str, ...]]] = []
KEPT_CALLS = 8


def _check_kept(when: str) -> None:
    """Put back and charge what threads left running wrote into what their calls were handed."""
    for owner, snapshot, keep in list(_kept):
        try:
            _check_unchanged(owner, snapshot, keep, late=when)
        except Exception:  # a device the thread left dead: the next call's error says so
            break


def _held_by_others(backend: Backend, handed: Snapshot) -> tuple[str, ...]:
    """The tensors of ``handed`` that share memory with what another backend's call that left a thread
    running was handed. A write into them is that thread's to answer for, found by :func:`_check_kept` now or
    before the next call: the thread may write after the kept copies are compared and before this call's own
    are, and the write would be charged to this call."""
    kept = [t for owner, snapshot, _ in _kept if owner is not backend for t in snapshot.tensors.values()]
    return tuple(name for name, t in handed.tensors.items() if any(_overlaps(t, other) for other in kept))


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes a tensor's elements occupy (first, one past the last)."""
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True)) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def check_output(backend: Backend, result: object, inputs: KDAInputs) -> BackendOutput:
    """``result`` as a BackendOutput of tensors on the inputs' device, none sharing memory with an input or
    with another returned tensor; a BackendFault otherwise."""
    if not isinstance(result, BackendOutput):
        shown = type(result).__name__ if not isinstance(result, tuple) else f"a tuple of {len(result)}"
        raise fault(backend, f"returned {shown}, not a BackendOutput")
    returned: dict[str, torch.Tensor] = {}
    for name in OUTPUT_TENSORS:
        value = getattr(result, name)
        if value is None and name != "o":
            continue
        if not isinstance(value, torch.Tensor):
            raise fault(backend, f"returned {name} as {type(value).__name__}, not a tensor")
        if value.device != inputs.device:
            where = "on the meta device (no data)" if value.is_meta else f"on {value.device}"
            raise fault(backend, f"returned {name} {where}; its inputs are on {inputs.device}")
        returned[name] = plain_tensor(value)
    given = input_tensors(inputs)
    for name, value in returned.items():
        for other, tensor in given.items():
            if _overlaps(value, tensor):
                raise fault(backend, f"returned {name} sharing memory with its input {other}", tensor=name, index=())
    names = list(returned)
    for i, name in enumerate(names):
        for other in names[i + 1 :]:
            if _overlaps(returned[name], returned[other]):
                raise fault(backend, f"returned {name} and {other} sharing memory", tensor=name, index=())
    # The suite's own copies: a backend that hands back one buffer it writes again on its next call would
    # otherwise change what an earlier call returned (a repeat compared with itself is always the same).
    return dataclasses.replace(result, **{name: value.clone() for name, value in returned.items()})


def plain_tensor(value: torch.Tensor) -> torch.Tensor:
    """A returned tensor subclass as the plain tensor of its data: the suite measures it with its own
    arithmetic, never the subclass's (one whose subtraction gave zeros passed every budget)."""
    if type(value) is torch.Tensor:
        return value
    with torch._C.DisableTorchFunctionSubclass():
        return value.as_subclass(torch.Tensor)


@contextlib.contextmanager
def _case_kept(backend: Backend, case: Case) -> Iterator[None]:
    """The Case a call is handed, frozen in fact: a field a backend set (``object.__setattr__`` gets past
    the frozen dataclass) is put back and is its failure; every later backend, check and record reads the
    case the suite drew."""
    fields = dict(vars(case))
    try:
        yield
    finally:
        changed = sorted(name for name, value in fields.items() if vars(case).get(name) is not value)
        for name in changed:
            object.__setattr__(case, name, fields[name])
        if changed:
            _breach(backend, f"changed the Case it was handed ({', '.join(changed)}; put back)")


def run_backend_call(backend: Backend, inputs: KDAInputs) -> BackendOutput:
    """``backend.run(inputs)`` under the contract (see the module's docstring)."""
    autotune_replay.activate(inputs.device)  # before the first launch: a cold machine replays, not tunes
    with _case_kept(backend, inputs.case), _in_call(backend, input_tensors(inputs)):
        result = backend.run(inputs)
    return check_output(backend, result, inputs)


def run_paged_call(
    backend: Backend,
    batch: KDAInputs,
    pool: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    out: torch.Tensor,
    checkpoint_slots: torch.Tensor,
) -> None:
    """``backend.run_paged(...)`` under the contract: the batch's tensors and the call's metadata unchanged,
    and of the pool only the slots the call names (its sequences' and its checkpoints') written."""
    autotune_replay.activate(batch.device)
    metadata = {"state_indices": state_indices, "has_initial_state": has_initial_state}
    metadata["checkpoint_slots"] = checkpoint_slots
    handed = {**input_tensors(batch), **metadata, "pool": pool}
    n = batch.case.num_seqs
    own = {int(s) for s in state_indices[:n].tolist()} | {int(s) for s in checkpoint_slots.tolist()}
    with _case_kept(backend, batch.case), _in_call(backend, handed, keep=("pool",)) as snapshot:  # pool: as left
        backend.run_paged(batch, pool, state_indices, has_initial_state, out, checkpoint_slots)
    _check_pool(backend, snapshot, own)


def _check_pool(backend: Backend, snapshot: Snapshot, own: set[int]) -> None:
    """Note a breach for each pool slot written that the call does not name. The pool stays as the backend
    left it: it is the check's to inspect (the poison check says whose slot it was)."""
    pool, before = snapshot.tensors["pool"], snapshot.copies["pool"]
    if pool.shape != before.shape:
        raise fault(backend, "changed the state pool's shape", tensor="pool", index=())
    changed = (bits(pool) != bits(before)).flatten(1).any(dim=1).nonzero().flatten().tolist()
    for slot in (slot for slot in changed if slot not in own):
        what = f"wrote pool slot {slot}, which its call does not name (the slots it may write: {sorted(own)})"
        _breaches.append(fault(backend, what, tensor="pool", slot=slot))
