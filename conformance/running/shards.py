"""How a night split over hosts (``--shard I/N``) shares its tests: whole backends to a shard, balanced by
what each backend's tests cost in a measured night on the same GPU model.

A test's shard was a hash of its name, so every shard held tests of every backend and its compile stage
had to compile nearly every (backend, kernel configuration) of the night: on a cold H200 (every backend,
shards of 4; docs/results/) 306 to 319 jobs, 78 to 101 s of each shard's wall. By backend, a shard
compiles its own backends' configurations only. The shares are balanced by cost: each backend's seconds
(the sum of its tests' wall, setup to teardown, over the night's workers) in a run recorded on this GPU
model, kept in ``shard_costs/<gpu>.json`` (written by ``kda-conformance shards --store S --run-id R``),
heaviest first onto the lightest shard (Graham's longest-processing-time rule). A backend the file does
not know weighs the mean of those it knows (each test weighs 1 where there is no file); a backend heavier
than a shard's share is split by test over as many shards as it needs.

Every host computes the same plan from the same test ids and the same committed file, without talking to
the others: the hosts of one night run the same code on the same GPU model.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kda_kernels.autotune_replay import gpu_slug
from kda_reports.runfile import number, read_object

FOLDER = Path(__file__).with_name("shard_costs")
# A GPU model with no cost file of its own takes the file of a model of the same architecture, where one is
# measured: only the balance between backends is used, and the kernels, their compile stage (on the host's
# CPU) and the SMs are the same; memory bandwidth differs. Not measured on the stand-in's own model: the
# header line says whose costs they are. The H100 (sm_90) takes the H200's until a night of its own is written.
STAND_INS = {"nvidia-h100-80gb-hbm3": "nvidia-h200"}


def backend_of(nodeid: str) -> str:
    """The backend a test runs (its first parameter: ``test_within_budget[fla_chunk]``,
    ``test_sentinel[vllm_chunk-T37_...-kda-...]``); a test with no parameter is its own group."""
    if not nodeid.endswith("]") or "[" not in nodeid:
        return nodeid
    return nodeid[nodeid.index("[") + 1 : -1].split("-", 1)[0]


@dataclass(frozen=True)
class Costs:
    """Seconds per backend in a measured night, and where they come from (for the header line)."""

    backends: Mapping[str, float]
    source: str = "no cost file: each test weighs the same"

    def of(self, backend: str, tests: int) -> float:
        if backend in self.backends:
            return self.backends[backend]
        if self.backends:
            return sum(self.backends.values()) / len(self.backends)
        return float(tests)


def costs_for(device_name: str | None, folder: Path = FOLDER) -> Costs:
    """The cost file of this GPU model, or none (the CPU, a model never measured)."""
    if not device_name:
        return Costs({})
    slug = gpu_slug(device_name)
    path, stand_in = folder / f"{slug}.json", ""
    if not path.exists() and slug in STAND_INS and (folder / f"{STAND_INS[slug]}.json").exists():
        path = folder / f"{STAND_INS[slug]}.json"
        stand_in = f", standing in for {device_name}, which has no cost file of its own (same architecture)"
    problems: list[str] = []
    data = read_object(path, problems)
    if data is None:
        why = problems[0] if problems else f"no cost file for {device_name} ({path.name})"
        return Costs({}, f"{why}: each test weighs the same")
    backends = data.get("backends")
    if not isinstance(backends, dict) or any(number(v) is None for v in backends.values()):
        return Costs({}, f"{path.name}: backends is no mapping of seconds: each test weighs the same")
    return Costs(
        {str(k): float(v) for k, v in backends.items()},
        f"{path.name} (run {data.get('run_id', '?')}, {data.get('date', '?')}{stand_in})",
    )


@dataclass(frozen=True)
class Plan:
    """The tests of each shard (0-based here; ``--shard I/N`` is 1-based) and each shard's planned cost."""

    shards: tuple[tuple[str, ...], ...]
    loads: tuple[float, ...]
    groups: tuple[tuple[str, ...], ...]  # each shard's backends (a split one: "name (part 2 of 3)")
    source: str  # where its costs came from (Costs.source)

    def line(self, index: int) -> str:
        """What shard ``index`` (1-based) runs, for the night's header."""
        total = sum(self.loads) or 1.0
        share = self.loads[index - 1] / total
        return (
            f"shard {index}/{len(self.shards)}: {len(self.shards[index - 1])} tests of "
            f"{', '.join(self.groups[index - 1]) or 'no backend'}; {share:.0%} of the night by cost ({self.source})"
        )


def _hash(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest(), 16)


def plan(nodeids: Sequence[str], count: int, costs: Costs) -> Plan:
    """Split ``nodeids`` into ``count`` shares: whole backends, heaviest first onto the lightest share."""
    by_backend: dict[str, list[str]] = {}
    for nodeid in nodeids:
        by_backend.setdefault(backend_of(nodeid), []).append(nodeid)
    weights = {name: costs.of(name, len(tests)) for name, tests in by_backend.items()}
    share = sum(weights.values()) / count if weights else 0.0
    groups: list[tuple[str, float, list[str]]] = []
    for name, tests in by_backend.items():
        parts = min(count, len(tests), max(1, math.ceil(weights[name] / share - 1e-9))) if share else 1
        if parts == 1:
            groups.append((name, weights[name], tests))
            continue
        for part in range(parts):  # a backend heavier than a share: its tests spread by a hash of their ids
            mine = [t for t in tests if _hash(t) % parts == part]
            groups.append((f"{name} (part {part + 1} of {parts})", weights[name] * len(mine) / len(tests), mine))
    shards: list[list[str]] = [[] for _ in range(count)]
    loads = [0.0] * count
    names: list[list[str]] = [[] for _ in range(count)]
    for name, weight, tests in sorted(groups, key=lambda group: (-group[1], group[0])):
        lightest = min(range(count), key=lambda i: (loads[i], i))
        shards[lightest] += tests
        loads[lightest] += weight
        names[lightest].append(name)
    order = {nodeid: i for i, nodeid in enumerate(nodeids)}  # each share in the collection's order
    return Plan(
        tuple(tuple(sorted(s, key=order.__getitem__)) for s in shards),
        tuple(loads),
        tuple(tuple(n) for n in names),
        costs.source,
    )


def backend_seconds(tests: Mapping[str, float]) -> dict[str, float]:
    """Seconds per backend from the seconds per test of a run (its timing files' ``tests``)."""
    seconds: dict[str, float] = {}
    for nodeid, value in tests.items():
        name = backend_of(nodeid)
        seconds[name] = seconds.get(name, 0.0) + float(value)
    return {name: round(value, 1) for name, value in sorted(seconds.items())}


def write(path: Path, device_name: str, run_id: str, seconds: Mapping[str, float], tests: int, note: str) -> None:
    """The cost file: small, one backend a line, dated."""
    data = {
        "device": device_name,
        "date": datetime.date.today().isoformat(),
        "run_id": run_id,
        "tests": tests,
        "command": note,
        "backends": dict(seconds),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def run_tests(timing_files: Iterable[Path], problems: list[str] | None = None) -> dict[str, float]:
    """Seconds per test over a run's timing files (one per part; the workers' own parts hold none). A file
    that cannot be read, or an entry that is not a test's seconds, is left out and named in ``problems``."""
    said = problems if problems is not None else []
    tests: dict[str, float] = {}
    for path in timing_files:
        timing = read_object(path, said) or {}
        entries = timing.get("tests", {})
        if not isinstance(entries, dict):
            said.append(f"{path.name}: tests is not a mapping; left out")
            continue
        for nodeid, seconds in entries.items():
            if number(seconds) is None:
                said.append(f"{path.name}: {nodeid}: not seconds; left out")
                continue
            tests[nodeid] = tests.get(nodeid, 0.0) + float(seconds)
    return tests
