"""What every backend on a case is measured against: its inputs, the float64 truth, and the budgets."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kda_cases.case import Case
from kda_cases.dtypes import bits
from kda_cases.materialize import KDAInputs, materialize
from kda_conformance.judging.metrics import measure_result
from kda_conformance.judging.tolerance import DEFAULT_RULE, BudgetRule, case_budgets, derive_budget
from kda_conformance.running.stages import CLOCK
from kda_kernels import registry, world
from kda_kernels.guard import run_backend_call
from kda_kernels.protocol import Backend, BackendOutput, WorkingPrecision
from kda_kernels.torch_chunk import TorchChunk
from kda_reference.chunked import DEFAULT_CHUNK
from kda_reference.recurrent import ReferenceResult
from kda_reference.run import reference_form, run_reference
from kda_reports.environment import library_version
from kda_reports.findings import Budget

# The same-precision baseline the tolerance rule scales (kernels/torch_chunk.py), by its registered name.
BASELINE = registry.BASELINE


@dataclass(frozen=True)
class CaseTruth:
    """Inputs, float64 truth and budgets of one case."""

    case: Case
    inputs: KDAInputs
    reference: ReferenceResult
    reference_form: str  # "loop" or "chunked"
    budgets: dict[str, Budget]
    reference_seconds: float
    # The working precision the budgets were set at (None: the case's own, the strict baseline's); truths a
    # check derives from this one (a request, a step) are set at it too.
    precision: WorkingPrecision | None = None


def case_truth(
    case: Case,
    device: torch.device,
    rule: BudgetRule = DEFAULT_RULE,
    precision: WorkingPrecision | None = None,
    drawn: KDAInputs | None = None,
) -> CaseTruth:
    """Materialize ``case`` on ``device`` (from its ``drawn`` CPU tensors where they were drawn ahead), run
    the reference and the same-precision baseline, derive budgets (at a declared working precision where
    one is given)."""
    with CLOCK.stage("materialize", device):
        inputs = materialize(case, device, drawn)
    return inputs_truth(inputs, rule, precision)


def inputs_truth(
    inputs: KDAInputs, rule: BudgetRule = DEFAULT_RULE, precision: WorkingPrecision | None = None
) -> CaseTruth:
    """The truth and budgets of given inputs (``inputs.case`` describes them; its initial state is the
    tensor's, which may be a stored state a request resumes from), at ``precision`` where one is declared."""
    case, device = inputs.case, inputs.device
    form = reference_form(inputs)
    with CLOCK.stage("reference", device, form) as lap:
        reference = run_reference(inputs, form)
    with CLOCK.stage("baseline", device):
        baseline = run_backend_call(registry.get(BASELINE), inputs)  # it must not write the inputs either
    with CLOCK.stage("compare", device):
        budgets = case_budgets(case, reference, measure_result(case, reference, baseline), rule)
    strict = _watched(CaseTruth(case, inputs, reference, form, budgets, lap.seconds))
    return strict if precision is None else at_precision(strict, precision, rule)


def at_precision(strict: CaseTruth, precision: WorkingPrecision, rule: BudgetRule = DEFAULT_RULE) -> CaseTruth:
    """The truth with its budgets set by the baseline at a declared working precision (kernels/torch_chunk.py
    ``TorchChunk.at_precision``), each keeping the strict budget beside it: the same inputs and float64
    truth, another baseline."""
    inputs, case, device = strict.inputs, strict.case, strict.inputs.device
    with CLOCK.stage("baseline", device):
        baseline = run_backend_call(TorchChunk.at_precision(precision), inputs)
    with CLOCK.stage("compare", device):
        measured = measure_result(case, strict.reference, baseline)
        declared = case_budgets(case, strict.reference, measured, rule, declared_roundoff=precision.unit_roundoff)
    budgets = {
        name: dataclasses.replace(budget, precision=precision.label, strict=strict.budgets[name])
        for name, budget in declared.items()
    }
    return _watched(dataclasses.replace(strict, budgets=budgets, precision=precision))


def declared_precision(backend: Backend, device: torch.device) -> WorkingPrecision | None:
    """The working precision ``backend`` declares, where its design holds for this run: on ``device``'s
    platform and the installed version of its libraries (``WorkingPrecision.holds_on``); None (the strict
    baseline) elsewhere. FLA's TF32 dots are NVIDIA's: in Triton's CPU interpreter its dots are IEEE. A backend
    whose ``chunk_tokens`` is larger than the baseline's chunk is held at its own chunk too."""
    precision = backend.working_precision
    if precision is not None:
        versions = " ".join(_version(lib.distribution, lib.source_variable) for lib in backend.libraries)
        precision = precision if precision.holds_on(device, versions) else None
    return _at_its_chunk(precision, backend)


def _at_its_chunk(precision: WorkingPrecision | None, backend: Backend) -> WorkingPrecision | None:
    """``precision`` with the backend's own chunk where that is larger than the baseline's: a kernel that does its
    float32 work over more tokens at once is held to what that costs the baseline (``WorkingPrecision.chunked``).
    A smaller chunk rounds less (docs/tolerance.md), so the baseline's chunk stays for it."""
    chunk = backend.chunk_tokens
    if chunk <= DEFAULT_CHUNK or (precision is not None and precision.chunk >= chunk):
        return precision
    if precision is None:
        return WorkingPrecision.chunked(chunk, f"{backend.name or type(backend).__name__}'s chunk_tokens")
    return dataclasses.replace(precision, chunk=chunk)


@functools.cache
def _version(distribution: str, source_variable: str) -> str:
    return library_version(distribution, source_variable)


def baseline_backend(precision: WorkingPrecision | None) -> Backend:
    """The baseline a truth's budgets come from: the registered one, or the one at a declared precision."""
    return registry.get(BASELINE) if precision is None else TorchChunk.at_precision(precision)


def widened(truth: CaseTruth, other: BackendOutput, rule: BudgetRule = DEFAULT_RULE) -> dict[str, Budget]:
    """The truth's budgets with the baseline's error taken as the larger of its whole run's and ``other``'s (the
    baseline computed another way the check computes the answer, a prefix and a suffix resumed from it): the
    rule's limits over the larger, so a check that splits a run holds the kernel to what splitting costs the
    baseline, not what one whole run happened to cost it."""
    case = truth.case
    measured = {m.tensor: m for m in measure_result(case, truth.reference, other)}
    budgets = {}
    for name, budget in truth.budgets.items():
        if name not in measured:
            budgets[name] = budget
            continue
        errors = measured[name].errors
        larger = dataclasses.replace(
            errors,
            max_abs=max(errors.max_abs, budget.max_abs.baseline),
            rel_rms=max(errors.rel_rms, budget.rel_rms.baseline),
        )
        ref = getattr(truth.reference, name)
        roundoff = truth.precision.unit_roundoff if truth.precision is not None else 0.0
        ref_max = float(ref.abs().max()) if ref.numel() else 0.0
        wide = derive_budget(case, name, larger, ref_max, rule, elements=ref.numel(), declared_roundoff=roundoff)
        budgets[name] = dataclasses.replace(wide, precision=budget.precision, strict=budget.strict)
    return budgets


REFERENCE_TENSORS = ("o", "final_state", "checkpoint_states")


@dataclass
class _Seal:
    """A truth as it was made: its objects, the sums of its float64 tensors' bits, its budgets."""

    reference: ReferenceResult
    tensors: tuple[torch.Tensor, ...]
    proved: tuple[torch.Tensor, ...]  # what a proof sums: the one buffer they are views of, or themselves
    sums: list[int]
    budgets: dict[str, Budget]


def _sums(tensors: tuple[torch.Tensor, ...]) -> list[int]:
    return _sums_of_each([tensors])[0]


def _sums_of_each(groups: list[tuple[torch.Tensor, ...]]) -> list[list[int]]:
    """Each group's sums of its tensors' bits (those that hold elements): one reduction per tensor and one
    transfer per device for all the groups (a proof holds up to a hundred truths: a stack and a transfer per
    truth were a tenth of its time)."""
    held = [[t for t in group if t.numel()] for group in groups]
    flat = [t for group in held for t in group]
    sums: dict[int, int] = {}
    for device in {t.device for t in flat}:
        mine = [t for t in flat if t.device == device]
        sums.update(zip(map(id, mine), torch.stack([bits(t).sum() for t in mine]).tolist(), strict=True))
    return [[sums[id(t)] for t in group] for group in held]


# Truths up to this size are put in one buffer (their copy is transient); past it a sum is bandwidth, not calls.
ONE_BUFFER_BYTES = 64 * 2**20


def _proved(reference: ReferenceResult) -> tuple[torch.Tensor, ...]:
    """What a proof of the reference sums: its tensors bound again as views of one flat buffer (values unchanged;
    already so for a declared precision's truth, which shares its strict truth's reference) and a 1-D view of
    that buffer, so that its proof is one reduction; its tensors themselves where they differ in dtype or device
    or pass ``ONE_BUFFER_BYTES``. After every call every truth alive is proved, and in the ``ci`` profile's
    controls a reduction per tensor took most of the run's CPU time."""
    tensors = tuple(getattr(reference, name) for name in REFERENCE_TENSORS)
    held = [t for t in tensors if t.numel()]
    if len(held) < 2 or len({(t.dtype, t.device) for t in held}) > 1:
        return tensors
    if not _is_one_buffer(held):
        if sum(t.nbytes for t in held) > ONE_BUFFER_BYTES:  # a long case's: its copy would cost memory, not time
            return tensors
        flat = torch.cat([t.reshape(-1) for t in held])
        start = 0
        for name, tensor in zip(REFERENCE_TENSORS, tensors, strict=True):
            if tensor.numel():
                object.__setattr__(reference, name, flat[start : start + tensor.numel()].view(tensor.shape))
                start += tensor.numel()
        held = [flat]
    return (held[0].as_strided((sum(t.numel() for t in tensors),), (1,), 0),)


def _is_one_buffer(tensors: list[torch.Tensor]) -> bool:
    """Whether the tensors are contiguous views of one storage, one after the other from its start."""
    storage = tensors[0].untyped_storage().data_ptr()
    at = 0
    for t in tensors:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage or t.storage_offset() != at:
            return False
        at += t.numel()
    return True


# The truths in use in this process, each sealed when made. A backend is handed inputs, not the truth, but
# can reach it (gc.get_objects()): one that overwrote it passed itself with garbage and failed the next
# backend. So after every call each truth in use is proved as it was made, and one that is not is made again
# in place and the change charged to the call (kernels/world.py). A truth a cache keeps between cases is
# parked instead (:func:`park`): proved once when it is taken out again (:func:`take_out`), not after every
# call. A run keeps up to 128 of them, and their proof after each call was most of the guard's time.
_seals: dict[int, tuple[weakref.ref, _Seal]] = {}
_parked: dict[int, tuple[weakref.ref, _Seal]] = {}


def _forget(key: int) -> None:
    _seals.pop(key, None)
    _parked.pop(key, None)


def _watched(truth: CaseTruth) -> CaseTruth:
    proved = _proved(truth.reference)
    tensors = tuple(getattr(truth.reference, name) for name in REFERENCE_TENSORS)
    seal = _Seal(truth.reference, tensors, proved, _sums(proved), dict(truth.budgets))
    _seals[id(truth)] = (weakref.ref(truth), seal)
    weakref.finalize(truth, _forget, id(truth))
    return truth


def park(truths: Iterable[CaseTruth]) -> None:
    """Stop proving ``truths`` after every call: a cache keeps them between cases, unused."""
    for truth in truths:
        if id(truth) in _seals:
            _parked[id(truth)] = _seals.pop(id(truth))


def take_out(truth: CaseTruth) -> list[str]:
    """A parked truth back in use: proved once (made again where it changed since it was parked, and said: no
    call can be charged with it then), and after every call from now on. Nothing for a truth in use."""
    if id(truth) not in _parked:
        return []
    _seals[id(truth)] = _parked.pop(id(truth))
    seal = _seals[id(truth)][1]
    return _prove([(truth, seal)], " while it was kept between cases (made again; which call wrote it is not known)")


def _prove_truths() -> list[str]:
    """Every truth in use proved as it was made; each that is not is made again, and said."""
    return _prove([(truth, seal) for held, seal in list(_seals.values()) if (truth := held()) is not None])


def _prove(alive: list[tuple[CaseTruth, _Seal]], said: str = " (made again)") -> list[str]:
    changes = []
    # Per reference: a declared precision's truth shares its strict truth's.
    proved = {id(seal.reference): seal.proved for _, seal in alive}
    sums = dict(zip(proved, _sums_of_each(list(proved.values())), strict=True))
    for truth, seal in alive:
        reference = truth.reference
        same = reference is seal.reference and all(
            getattr(reference, name) is t for name, t in zip(REFERENCE_TENSORS, seal.tensors, strict=True)
        )
        if id(seal.reference) not in sums:  # made again for a truth before it: proved afresh
            sums[id(seal.reference)] = _sums(seal.proved)
        if same and truth.budgets == seal.budgets and sums[id(seal.reference)] == seal.sums:
            continue
        _remake(truth, seal)
        sums.pop(id(seal.reference))
        changes.append(f"changed the suite's float64 truth of case {truth.case.id}{said}")
    return changes


def _remake(truth: CaseTruth, seal: _Seal) -> None:
    """The truth as it was made: its own objects bound again, the reference computed again into them."""
    object.__setattr__(truth, "reference", seal.reference)
    for name, tensor in zip(REFERENCE_TENSORS, seal.tensors, strict=True):
        object.__setattr__(seal.reference, name, tensor)
    fresh = run_reference(truth.inputs, truth.reference_form)
    with torch.no_grad():
        for name, tensor in zip(REFERENCE_TENSORS, seal.tensors, strict=True):
            tensor.copy_(getattr(fresh, name))
    if not isinstance(truth.budgets, dict):
        object.__setattr__(truth, "budgets", {})
    truth.budgets.clear()
    truth.budgets.update(seal.budgets)


world.add_watcher(_prove_truths)
