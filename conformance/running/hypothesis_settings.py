"""How Hypothesis searches a profile's cases: its settings, the seed each check draws from, and the count
of examples each test ran (from Hypothesis's own observations, not a counter of ours)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import hypothesis
from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.internal import observability

from kda_cases.profiles import Profile

FAILURE_DATABASE = ".hypothesis/kda-conformance"
T = TypeVar("T", bound=Callable[..., Any])


def configure_hypothesis(profile: Profile) -> None:
    """Load the profile's settings: its examples, no deadline, a failure database where it searches afresh."""
    settings.register_profile(
        f"kda-{profile.name}",
        max_examples=profile.max_examples,
        deadline=None,
        derandomize=profile.derandomize,
        # A derandomized profile replays the same cases every run: no failure database to consult.
        database=None if profile.derandomize else DirectoryBasedExampleDatabase(FAILURE_DATABASE),
        # No "@reproduce_failure" blob: every failure prints the repro line that reruns it.
        print_blob=False,
        # No shrinking in any profile: with compiled kernels every shrunk case is a new shape and a new Triton
        # compile (on the H200 one fp32 failure's shrinking took about 450 s of a 540 s nightly slot and no
        # other property ran); in the CPU interpreter it takes minutes. The failing case is printed whole,
        # with its repro line, and kept in the failure database.
        phases=[phase for phase in Phase if phase not in (Phase.shrink, Phase.explain)],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
    )
    settings.load_profile(f"kda-{profile.name}")


def check_seed(pinned: int, profile: Profile, run_seed: int | None) -> int:
    """The seed a check's test draws from: its pinned seed in a derandomized profile (so editing the check's
    code does not change which cases CI runs), the run's seed otherwise."""
    if profile.derandomize or run_seed is None:
        return pinned
    return run_seed


def seed_check_test(test: T, name: str, seed: int | None, max_examples: int | None = None) -> T:
    """A check's Hypothesis test (the function ``given`` made) given its seed (none: Hypothesis's own), at most
    ``max_examples`` examples where the check caps them, and, where the profile keeps failures, a folder of its
    own in the failure database (every check's test is made from one function, which Hypothesis would
    otherwise take for one test and share saved failures between)."""
    base = settings()  # the loaded profile's
    database = base.database
    if isinstance(database, DirectoryBasedExampleDatabase):
        database = DirectoryBasedExampleDatabase(Path(database.path) / name)
    if seed is not None:
        hypothesis.seed(seed)(test)  # before the settings: it sets its own, without a database
    cap = base.max_examples if max_examples is None else min(max_examples, base.max_examples)
    return settings(base, database=database, max_examples=cap)(test)


class ExampleLog:
    """Per pytest test: its check and backend, how many examples Hypothesis ran until the check first
    failed (from the observations Hypothesis delivers; examples it gave up on do not count), and that
    failure's findings. An example that raised instead of reporting findings is a test error, not a
    finding: it ends the count and is named under ``raised``. A test that is not a Hypothesis test (a
    corpus case) counts one example."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, Any]] = {}

    def open(self, nodeid: str, check: str, backend: str) -> dict[str, Any]:
        return self.entries.setdefault(
            nodeid,
            {"check": check, "backend": backend, "examples": 0, "failed_at": None, "raised": "", "findings": []},
        )

    def observe(self, observation: Any) -> None:
        """Hypothesis's observability callback: one call per test case it ran."""
        if getattr(observation, "type", "") != "test_case" or not observation.how_generated.startswith("during "):
            return  # not an example, or the replay of a failure already counted
        entry = self.entries.get(observation.property)
        if entry is None or entry["failed_at"] is not None or entry["raised"] or observation.status == "gave_up":
            return
        if observation.status == "failed" and not entry["findings"]:
            entry["raised"] = observation.status_reason
            return
        entry["examples"] += 1
        if observation.status == "failed":
            entry["failed_at"] = entry["examples"]

    def ran_once(self, nodeid: str, failed: bool) -> None:
        entry = self.entries[nodeid]
        entry["examples"] = 1
        entry["failed_at"] = 1 if failed else None

    def keep_failure(self, nodeid: str, findings: list[dict]) -> None:
        """The findings of the test's first failure (later ones are Hypothesis replaying it)."""
        entry = self.entries[nodeid]
        if not entry["findings"]:
            entry["findings"] = findings


def observe_examples(log: ExampleLog) -> None:
    """Count examples from Hypothesis's observations, without the line coverage Hypothesis would otherwise
    trace for each of them (tracing makes interpreted Triton kernels several times slower)."""
    observability.OBSERVABILITY_COLLECT_COVERAGE = False
    observability.add_observability_callback(log.observe)


def stop_observing(log: ExampleLog) -> None:
    observability.remove_observability_callback(log.observe)
