"""The pytest plugin: options, the device under test, device markers, and the report a run leaves."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shlex
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import hypothesis
import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from kda_cases.case import Case
from kda_cases.profiles import Profile, get_profile
from kda_cases.strategies import kernel_pool_lines, with_kernel_pool
from kda_conformance.stages import CLOCK
from kda_conformance.sweep import (
    FIRST_SWEEP_LENGTHS,
    RECORD_LINE_HEADER,
    CaseTruth,
    Outcome,
    case_truth,
    first_sweep_cases,
    outcome_records,
    parse_dtypes,
    parse_lengths,
    record_line,
    resolve_device,
)
from kda_kernels import registry, triton_interpret
from kda_kernels.protocol import Backend
from kda_reference.run import FORM_VARIABLE, FORMS

RECORDS = pytest.StashKey[list[dict]]()
PROFILE = pytest.StashKey[Profile]()
SEED = pytest.StashKey[int | None]()
RECORDER = pytest.StashKey[object]()
CHECKS = pytest.StashKey[dict[str, dict]]()
WRITTEN = pytest.StashKey[dict[str, Path]]()
STRICT = pytest.StashKey[bool]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kda", "KDA conformance")
    group.addoption("--kda-device", default="auto", help="device under test: auto (default), cpu, cuda, cuda:N")
    group.addoption(
        "--kda-backend",
        action="append",
        default=None,
        metavar="NAME",
        help="backend to test (repeatable); default: every registered backend",
    )
    group.addoption(
        "--kda-plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE, which registers more backends (repeatable)",
    )
    group.addoption("--kda-lengths", default=None, help="first-sweep sequence lengths, e.g. 37,2048,32768")
    group.addoption("--kda-dtypes", default="bf16,fp32", help="first-sweep input dtypes (default: bf16,fp32)")
    group.addoption("--kda-heads", type=int, default=2, help="first-sweep heads, H = HV (default: 2)")
    group.addoption("--kda-head-dim", type=int, default=64, help="first-sweep K = V (default: 64)")
    group.addoption("--kda-out", default="out", help="where a run's report goes (default: out)")
    group.addoption(
        "--kda-profile",
        default=None,
        help="sweep profile for the property tests: smoke, ci, nightly, long "
        "(default: ci on a CPU, nightly on a GPU; also KDA_PROFILE)",
    )
    group.addoption(
        "--kda-seed",
        type=int,
        default=None,
        help="seed of a randomized profile's search (default: a fresh one, printed and recorded in the report)",
    )
    group.addoption(
        "--kda-strict",
        action="store_true",
        default=None,
        help="a selected backend or device that is missing fails instead of skipping, so a CI job cannot go "
        "green by skipping everything (also KDA_STRICT=1)",
    )
    group.addoption(
        "--kda-reference-form",
        choices=FORMS,
        default=None,
        help="exact form of the float64 truth: auto (default: the chunked form from a few tokens on), loop "
        "(the token-by-token definition) or chunked (also KDA_REFERENCE_FORM)",
    )
    group.addoption(
        "--kda-examples",
        type=int,
        default=None,
        help="cases per property and backend (default: the profile's; recorded with the profile's name)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kda_device_dependent: runs on the device chosen by --kda-device")
    config.stash[RECORDS] = []
    config.stash[CHECKS] = {}
    _share_cores()
    strict = config.getoption("--kda-strict")
    config.stash[STRICT] = bool(strict) if strict is not None else os.environ.get("KDA_STRICT", "") not in ("", "0")
    for module in config.getoption("--kda-plugin"):
        try:
            registry.load_plugin(module)
        except registry.PluginError as exc:
            raise pytest.UsageError(f"--kda-plugin: {exc}") from None
    _configure_profile(config)
    if config.getoption("--kda-reference-form"):
        # The environment carries it into pytest-xdist workers and isolated case processes alike.
        os.environ[FORM_VARIABLE] = config.getoption("--kda-reference-form")
    # On a CPU the FLA kernels run in Triton's interpreter, which must be switched on
    # before anything imports triton or fla (test modules included).
    if _device(config).type == "cpu" and not triton_interpret.problem():
        triton_interpret.enable()


def _share_cores() -> None:
    """In a pytest-xdist worker, give torch this worker's share of the cores. Each worker would otherwise
    start one thread per core, and on a busy machine every small parallel op waits for a thread that
    another worker's process holds."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def _configure_profile(config: pytest.Config) -> None:
    """Pick the profile and give Hypothesis its settings: no deadline, a failure database, the repro printed."""
    name = config.getoption("--kda-profile") or os.environ.get("KDA_PROFILE")
    if name is None:
        name = "ci" if _device(config).type == "cpu" else "nightly"
    try:
        profile = get_profile(name)
    except ValueError as exc:
        raise pytest.UsageError(f"--kda-profile: {exc}") from None
    examples = config.getoption("--kda-examples")
    if examples is not None:
        if examples < 1:
            raise pytest.UsageError(f"--kda-examples: {examples} must be a positive number of cases")
        profile = dataclasses.replace(profile, max_examples=examples)
    seed = config.getoption("--kda-seed")
    if seed is None and not profile.derandomize:
        seed = secrets.randbelow(2**31)
    config.stash[PROFILE] = with_kernel_pool(profile, seed)
    config.stash[SEED] = seed
    settings.register_profile(
        f"kda-{profile.name}",
        max_examples=profile.max_examples,
        deadline=None,
        derandomize=profile.derandomize,
        # A derandomized profile replays the same cases every run: no failure database to consult.
        database=None if profile.derandomize else DirectoryBasedExampleDatabase(".hypothesis/kda-conformance"),
        print_blob=True,
        # No shrinking in any profile: with compiled kernels every shrunk case is a new shape and a new Triton
        # compile (on the H200 one fp32 failure's shrinking took about 450 s of a 540 s nightly slot and no
        # other property ran); in the CPU interpreter it takes minutes. The failing case is printed whole,
        # with its repro line, and kept in the failure database.
        phases=[phase for phase in Phase if phase not in (Phase.shrink, Phase.explain)],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
    )
    settings.load_profile(f"kda-{profile.name}")
    if seed is not None:
        # What Hypothesis's own --hypothesis-seed does: every @given test starts from this seed.
        hypothesis.core.global_force_seed = seed


def _device(config: pytest.Config) -> torch.device:
    try:
        return resolve_device(config.getoption("--kda-device"))
    except ValueError as exc:
        raise pytest.UsageError(f"--kda-device: {exc}") from None


def selected_backends(config: pytest.Config) -> list[str]:
    chosen = config.getoption("--kda-backend")
    known = registry.names()
    if chosen:
        unknown = [name for name in chosen if name not in known]
        if unknown:
            raise pytest.UsageError(f"--kda-backend {unknown} unknown; known backends: {', '.join(known)}")
        return chosen
    return known


def first_sweep(config: pytest.Config) -> list[Case]:
    try:
        lengths = parse_lengths(config.getoption("--kda-lengths")) if config.getoption("--kda-lengths") else None
        dtypes = parse_dtypes(config.getoption("--kda-dtypes"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    return first_sweep_cases(
        lengths=lengths or FIRST_SWEEP_LENGTHS,
        dtypes=dtypes,
        num_heads=config.getoption("--kda-heads"),
        head_dim=config.getoption("--kda-head-dim"),
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kda_backend_name" in metafunc.fixturenames:
        metafunc.parametrize("kda_backend_name", selected_backends(metafunc.config))
    if "first_sweep_case" in metafunc.fixturenames:
        cases = first_sweep(metafunc.config)
        metafunc.parametrize("first_sweep_case", cases, ids=[c.id for c in cases])


# Long GPU cases hold gigabytes of truth; a handful is enough for every backend to reuse a case.
TRUTH_CACHE_SIZE = 4


@pytest.fixture(scope="session")
def kda_profile(request: pytest.FixtureRequest) -> Profile:
    """The sweep profile chosen by --kda-profile (or KDA_PROFILE, or the device's default)."""
    return request.config.stash[PROFILE]


@pytest.fixture
def kda_backend(request: pytest.FixtureRequest, kda_backend_name: str, kda_device: torch.device) -> Backend:
    """The backend under test, able to run on the device; otherwise the test skips, naming what is missing,
    or fails under --kda-strict (KDA_STRICT=1), so a CI job cannot go green by skipping everything."""
    backend = registry.get(kda_backend_name)
    available = backend.availability(kda_device)
    if not available:
        missing = f"{kda_backend_name} cannot run on {kda_device}: {available.reason}"
        if request.config.stash[STRICT]:
            pytest.fail(f"--kda-strict: {missing}", pytrace=False)
        pytest.skip(missing)
    return backend


@pytest.fixture(scope="session")
def kda_device(request: pytest.FixtureRequest) -> torch.device:
    return _device(request.config)


@pytest.fixture(scope="session")
def kda_truth() -> Callable[[Case, torch.device], CaseTruth]:
    """Inputs, float64 truth and budgets per case, kept for the last few cases (each backend reuses them)."""
    cache: OrderedDict[tuple[str, str], CaseTruth] = OrderedDict()

    def get(case: Case, device: torch.device) -> CaseTruth:
        key = (case.id, str(device))
        if key not in cache:
            cache[key] = case_truth(case, device)
            while len(cache) > TRUTH_CACHE_SIZE:
                cache.popitem(last=False)
        cache.move_to_end(key)
        return cache[key]

    return get


@pytest.fixture
def kda_record(request: pytest.FixtureRequest) -> Callable[[Outcome], None]:
    """Adds an outcome's rows to this pytest run's report."""

    def record(outcome: Outcome) -> None:
        rows = [{**row, "test": request.node.nodeid} for row in outcome_records(outcome)]
        request.config.stash[RECORDS].extend(rows)
        recorder = _recorder(request.config)
        if recorder is not None:
            recorder.add(rows)
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if request.config.getoption("verbose") > 0 and reporter is not None:
            # With -v, numbers appear as they are measured, so a run cut short still shows them.
            for row in rows:
                reporter.write_line(record_line(row))

    return record


@pytest.fixture
def kda_check(request: pytest.FixtureRequest) -> Callable[[str | None], None]:
    """Ends each example a property checks: ``check(None)`` passes it, ``check(message)`` fails it.

    Counts the examples of each test until its first failure and keeps that failure's message, for the
    run's ``<run_id>.checks.json`` (how many cases it took to catch a bug; how many ran).
    """
    callspec = getattr(request.node, "callspec", None)
    entry = request.config.stash[CHECKS].setdefault(
        request.node.nodeid,
        {
            "test": request.node.originalname,
            "backend": callspec.params.get("kda_backend_name", "") if callspec else "",
            "examples": 0,
            "failed_at": None,
            "message": "",
        },
    )

    def check(message: str | None) -> None:
        if entry["failed_at"] is None:  # later examples are Hypothesis replaying or shrinking the failure
            entry["examples"] += 1
            if message:
                entry["failed_at"], entry["message"] = entry["examples"], message
        if message:
            raise AssertionError(message)

    return check


def _recorder(config: pytest.Config):  # type: ignore[no-untyped-def]
    """The run's recorder, made at the first record; None where pandas (the report writer) is missing."""
    if RECORDER not in config.stash:
        try:
            from kda_reports.environment import environment
            from kda_reports.runfile import RunRecorder
        except ImportError:
            config.stash[RECORDER] = None
        else:
            command = "pytest " + " ".join(shlex.quote(a) for a in config.invocation_params.args)
            profile, seed = config.stash[PROFILE], config.stash[SEED]
            env = {**environment(_device(config)), "command": command, "profile": profile.name}
            env["seed"] = "" if seed is None else seed
            config.stash[RECORDER] = RunRecorder(env, Path(config.getoption("--kda-out")))
    return config.stash[RECORDER]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Conformance tests run on the chosen device: mark them so `-m cpu` / `-m cuda` select them.
    device = _device(config)
    marker = "cpu" if device.type == "cpu" else ("rocm" if torch.version.hip else "cuda")
    markers_of: dict[str, tuple[str, ...]] = {}
    for item in items:
        if item.get_closest_marker("kda_device_dependent"):
            item.add_marker(getattr(pytest.mark, marker))
        name = getattr(getattr(item, "callspec", None), "params", {}).get("kda_backend_name")
        if name is not None:
            if name not in markers_of:
                markers_of[name] = registry.get(name).markers(device)
            for backend_marker in markers_of[name]:
                item.add_marker(getattr(pytest.mark, backend_marker))
    # Corpus cases outermost, backends inside: each case's truth (the float64 reference and the baseline,
    # minutes at 128K) is computed once and served to every backend from the truth cache.
    slots = [i for i, item in enumerate(items) if "entry" in getattr(getattr(item, "callspec", None), "params", {})]
    first_seen: dict[str, int] = {}
    for i in slots:
        first_seen.setdefault(items[i].callspec.params["entry"].case.id, len(first_seen))
    in_case_order = sorted(
        (items[i] for i in slots), key=lambda item: first_seen[item.callspec.params["entry"].case.id]
    )
    for i, item in zip(slots, in_case_order, strict=True):
        items[i] = item


def pytest_report_header(config: pytest.Config) -> list[str]:
    seed, profile = config.stash[SEED], config.stash[PROFILE]
    how = "derandomized" if seed is None else f"seed {seed} (rerun with --kda-seed {seed})"
    examples = f"{profile.max_examples} examples per property"
    header = f"kda-conformance: device {_device(config)}, profile {profile.name} ({examples}), {how}"
    return [header, *kernel_pool_lines(profile)]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the run's files where the tests ran: in the process itself, or in each pytest-xdist worker
    (each worker's rows become a run of their own; the controller ran none)."""
    config = session.config
    rows, checks = config.stash.get(RECORDS, []), config.stash.get(CHECKS, {})
    written: dict[str, Path] = {}
    if (rows or checks) and _recorder(config) is not None:
        recorder = _recorder(config)
        if checks:
            from kda_reports.runfile import atomic_write

            path = recorder.out_dir / "runs" / f"{recorder.run_id}.checks.json"
            atomic_write(path, lambda p: p.write_text(json.dumps(checks, indent=1)))
            written["checks"] = path
        if rows:
            written |= recorder.finish(timing=CLOCK.snapshot())[1]
    config.stash[WRITTEN] = written
    if hasattr(config, "workeroutput"):  # a pytest-xdist worker: its stage totals go to the controller
        config.workeroutput["kda_stages"] = json.dumps(CLOCK.drain())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # type: ignore[no-untyped-def]
    taken = getattr(node, "workeroutput", {}).get("kda_stages")
    if taken:
        CLOCK.absorb(json.loads(taken))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    rows, checks = config.stash.get(RECORDS, []), config.stash.get(CHECKS, {})
    written = config.stash.get(WRITTEN, {})
    tr = terminalreporter
    if checks:
        tr.section("KDA conformance: examples checked per test (and the first that failed)")
        for nodeid, entry in checks.items():
            failed = "" if entry["failed_at"] is None else f", failed at example {entry['failed_at']}"
            tr.write_line(f"{nodeid}: {entry['examples']} examples{failed}")
        if "checks" in written:
            tr.write_line(f"checks: {written['checks']}")
    if any(CLOCK.calls.values()):
        tr.section("KDA conformance: the suite's own time by stage (all workers)")
        for line in CLOCK.lines():
            tr.write_line(line)
        if "timing" in written:
            tr.write_line(f"timing: {written['timing']}")
    if not rows:
        return
    tr.section("KDA conformance: max-abs error against the float64 reference")
    tr.write_line(RECORD_LINE_HEADER)
    for row in rows:
        tr.write_line(record_line(row))
    if "records" not in written:
        tr.write_line("no report file written: pandas is not installed")
        return
    tr.write_line(f"report: {written['records']} and {written['summary_md']}")
