"""The committed corpus (cases/corpus/*.json) against every selected backend, in every profile."""

from __future__ import annotations

import pytest

from kda_cases.corpus import CorpusEntry, load_corpus
from kda_conformance.sweep import run_backend
from kda_conformance.tolerance import failure_message

ENTRIES = load_corpus()


@pytest.mark.kda_device_dependent
@pytest.mark.parametrize("entry", ENTRIES, ids=[e.case.id for e in ENTRIES])
def test_corpus_case(
    entry: CorpusEntry, kda_backend, kda_profile, kda_device, kda_truth, kda_record, kda_check
) -> None:  # type: ignore[no-untyped-def]  # type: ignore[no-untyped-def]
    case = entry.case
    backend = kda_backend
    too_large = kda_profile.corpus_skip(case, backend.interpreted(kda_device))
    if too_large:
        pytest.skip(too_large)
    outcome = run_backend(kda_truth(case, kda_device), backend)
    kda_record(outcome)
    if outcome.status == "skip":
        pytest.skip(f"{backend.name}: {outcome.reason}")
    if outcome.status != "ran":
        kda_check(f"{case.id} {backend.name} raised {outcome.reason}\n  repro: {outcome.repro}")
    failures = [failure_message(case, backend.name, v, outcome.repro) for v in outcome.failed]
    kda_check(f"pinned because: {entry.why}\n" + "\n".join(failures) if failures else None)
