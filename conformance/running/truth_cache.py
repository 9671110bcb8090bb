"""The truths of a run's recent cases, kept so that every backend of a case reuses them: inputs, float64
truth and the strict budgets once per case, and the budgets of each declared working precision beside them."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Mapping

import torch

from kda_cases.case import Case
from kda_cases.materialize import KDAInputs, drawn_on_cpu
from kda_conformance.running.memory import TRUTH_CACHE_GIB
from kda_conformance.running.stages import CLOCK
from kda_conformance.running.truth import CaseTruth, at_precision, case_truth, park, take_out
from kda_kernels.protocol import WorkingPrecision

# A property test draws the same cases for every backend of a check (its seed is the check's), one backend's
# examples after another's: a cache that holds a test's examples gives the next backends every truth (two
# correct controls over 53 cases: all 53 shared). Between cases a worker keeps at most TRUTH_CACHE_GIB of them
# (memory outside the GPU's shares, in the night's memory plan): long GPU cases hold gigabytes, so there it is
# the bytes that bound the cache, not the count.
TRUTH_CACHE_SIZE = 128


def tensor_bytes(value: object) -> int:
    """The bytes of every tensor in ``value`` (a tensor, a dataclass, a mapping or a sequence of them)."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(tensor_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, Mapping):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    return 0


class TruthCache:
    """The last few cases' truths on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._strict: OrderedDict[str, CaseTruth] = OrderedDict()
        self._declared: dict[tuple[str, WorkingPrecision], CaseTruth] = {}
        self._drawn: dict[str, KDAInputs] = {}  # at most one case's CPU tensors, drawn ahead
        self._bytes: dict[str, int] = {}  # the strict truths' bytes, by case
        self._spoiled: list[str] = []  # what take_out found of truths written while they were kept

    def draw_ahead(self, case: Case) -> None:
        """Draw ``case``'s tensors on the CPU now, where its truth is not kept yet: what its truth needs that
        takes no device memory, done before the case takes its share of the GPU. On the H200 a shard's
        workers spent 465 s drawing inputs, and 496 s waiting for shares others held while they drew."""
        if case.id in self._strict or case.id in self._drawn:
            return
        self._drawn.clear()
        try:
            with CLOCK.stage("materialize", torch.device("cpu")):
                self._drawn[case.id] = drawn_on_cpu(case)
        except Exception:  # drawn again inside the case's guarded attempt, which records what it raises
            pass

    def get(self, case: Case, precision: WorkingPrecision | None = None) -> CaseTruth:
        """Inputs, float64 truth and budgets of ``case``, set at ``precision`` (a backend's declared working
        precision) where one is given: that reuses the case's inputs and truth, with another baseline."""
        if case.id not in self._strict:
            self._strict[case.id] = case_truth(case, self.device, drawn=self._drawn.pop(case.id, None))
        self._strict.move_to_end(case.id)
        strict = self._strict[case.id]
        self._spoiled += take_out(strict)
        if precision is None:
            return strict
        key = (case.id, precision)
        if key not in self._declared:
            self._declared[key] = at_precision(strict, precision)
        self._spoiled += take_out(self._declared[key])
        return self._declared[key]

    def take_spoiled(self) -> list[str]:
        """What was found, when a kept truth was taken out again, of a write into it while it was kept."""
        spoiled, self._spoiled = self._spoiled, []
        return spoiled

    def trim(self) -> None:
        """Keep what the memory plan allows between cases: at most TRUTH_CACHE_SIZE truths and TRUTH_CACHE_GIB
        of them, the oldest dropped first (the case just run too, when it alone is larger)."""
        while len(self._strict) > TRUTH_CACHE_SIZE:
            self._strict.popitem(last=False)
        # Each truth's bytes counted once (a walk of a truth's dataclasses is 0.1 ms; 128 of them after every case
        # were 7 % of the controls' run).
        self._bytes = {case_id: self._bytes.get(case_id) or tensor_bytes(t) for case_id, t in self._strict.items()}
        while self._strict and sum(self._bytes.values()) > TRUTH_CACHE_GIB * 2**30:
            case_id, _ = self._strict.popitem(last=False)
            del self._bytes[case_id]
        # A declared precision's budgets share their case's tensors: kept while the case is.
        self._declared = {key: truth for key, truth in self._declared.items() if key[0] in self._strict}
        park([*self._strict.values(), *self._declared.values()])  # kept, unused until taken out again

    def clear(self) -> None:
        self._strict.clear()
        self._bytes.clear()
        self._declared.clear()
        self._drawn.clear()
