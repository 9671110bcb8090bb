"""The pytest plugin: pytest's options become the run's configuration (``running/config.py``); fixtures
hand tests the run, the device and the backend under test; hooks mark, seed and order the tests and
report the run. What a run does lives below this module; here it is only wired to pytest."""

from __future__ import annotations

import atexit
import json
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import pytest
import torch

from kda_cases.case import Case
from kda_cases.grids import FIRST_SWEEP_DTYPES
from kda_conformance.checks import CHECKS, Check
from kda_conformance.checks.gradients import NAME as GRADIENTS
from kda_conformance.pytest_summary import DEPARTED, EXPECTED, RUN, WRITTEN, empty_selection, not_checked
from kda_conformance.pytest_summary import pytest_terminal_summary as pytest_terminal_summary
from kda_conformance.running.config import Grid, baseline_warning, build_config
from kda_conformance.running.faults import DEVICE_LOST_EXIT, DeviceLost
from kda_conformance.running.hypothesis_settings import (
    check_seed,
    configure_hypothesis,
    observe_examples,
    stop_observing,
)
from kda_conformance.running.interrupts import say_stopping, sigterm_as_interrupt
from kda_conformance.running.memory import chosen_gpus, visible_device
from kda_conformance.running.not_checked import NOT_CHECKED_EXIT
from kda_conformance.running.option_values import PURPOSE_VARIABLE, ConfigError
from kda_conformance.running.options import add_pytest_options, config_keywords
from kda_conformance.running.run import Run
from kda_conformance.running.runnable import Drawn
from kda_conformance.running.stages import CLOCK
from kda_kernels import guard, registry, triton_interpret
from kda_kernels.guard import BackendFault
from kda_kernels.left_work import exit_past_left_work, flush_and_exit
from kda_kernels.protocol import Backend
from kda_reports.console import RECORD_LINE_HEADER, record_line
from kda_reports.findings import Finding, stale_known_issues
from kda_reports.history import read_expected, tonight_departures
from kda_reports.runfile import release_claims
from kda_reports.store import load_store

# Whether this process writes the run (not a pytest-xdist worker): pytest_runtest_logreport has no config.
_WRITES_RUN = [True]
# A nightly's controller: its config, whose terminal names each failed test as it is reported.
_NIGHT_CONFIG: list[pytest.Config | None] = [None]
SHARD_LINE = pytest.StashKey[str]()  # --kda-shard: what this host's shard runs, for the header
HEADER_SHOWN = pytest.StashKey[bool]()  # -v: the record lines' header, once per session
SIGTERM_BEFORE = pytest.StashKey[object]()  # the SIGTERM handler this session replaced


def pytest_addoption(parser: pytest.Parser) -> None:
    """The run's options as ``--kda-NAME``, from the one table the command line shares (running/options.py),
    and ``--kda-expected``, which is pytest's side of ``nightly --expected``."""
    group = parser.getgroup("kda", "KDA conformance")
    add_pytest_options(group)
    group.addoption(
        "--kda-expected",
        default=None,
        metavar="FILE",
        help="a team's expected-status file (kda-conformance history --expected; docs/ci.md): after the session, "
        "a cell of this run that left its expected status fails the session and is named",
    )


def _run_config(config: pytest.Config):
    option = config.getoption
    # Under pytest-xdist the controller fixes the seed and the run id, so that every worker draws from the
    # same seed and writes a part of the same run.
    seed, run_id = option("--kda-seed"), option("--kda-run-id")
    if hasattr(config, "workerinput"):
        seed = config.workerinput["kda_seed"] if seed is None else seed
        run_id = config.workerinput["kda_run_id"]
    try:
        lengths = option("--kda-lengths")
        grid = Grid(
            **({"lengths": lengths} if lengths else {}),
            dtypes=option("--kda-dtypes") or FIRST_SWEEP_DTYPES,
            heads=option("--kda-heads"),
            head_dim=option("--kda-head-dim"),
        )
        command = "pytest " + " ".join(shlex.quote(a) for a in _recorded_args(config.invocation_params.args))
        return build_config(
            **config_keywords(lambda o: option(f"--kda-{o.name}"))
            | dict(
                default_profile=True,
                seed=seed,
                grid=grid,
                command=command,
                purpose=os.environ.get(PURPOSE_VARIABLE) or "pytest",
                run_id=run_id,
            )
        )
    except ConfigError as exc:
        raise pytest.UsageError(exc.shown_as("kda-")) from None
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


# The checkout the suite runs from: its test files' paths are recorded relative to it.
CHECKOUT = Path(__file__).resolve().parent.parent


def _recorded_args(args: Sequence[str]) -> list[str]:
    """pytest's arguments as a run records them: the same on every machine (the suite's test files relative
    to its checkout, as `kda-conformance nightly` passes them absolute), the output folder left out (where a
    run was written is not part of what it ran)."""
    recorded, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg == "--kda-out":
            skip = True
            continue
        if arg.startswith("--kda-out="):
            continue
        path = Path(arg.split("::", 1)[0])
        if path.is_absolute() and path.is_relative_to(CHECKOUT):
            arg = str(Path(arg).relative_to(CHECKOUT)) if "::" not in arg else arg.replace(f"{CHECKOUT}/", "", 1)
        recorded.append(arg)
    return recorded


# The session's exit status, for an exit that cannot wait on a thread a backend left running.
_EXIT_STATUS = [int(pytest.ExitCode.INTERNAL_ERROR)]


def _exit_past_left_work() -> None:
    """Run first at interpreter exit, before it joins the threads: one a backend left running would hold
    the exit forever, a child it left would hold the run's pipes (everything is written by then)."""
    exit_past_left_work(_EXIT_STATUS[0])


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kda_device_dependent: runs on the device chosen by --kda-device")
    if _exit_past_left_work not in getattr(threading, "_threading_atexits", []):
        threading._register_atexit(_exit_past_left_work)  # public since 3.9 in all but name (concurrent.futures)
    _share_cores()
    # A CI job's time limit (SIGTERM to every process) stops the controller and each worker as Ctrl-C does.
    config.stash[SIGTERM_BEFORE] = sigterm_as_interrupt()
    worker = getattr(config, "workerinput", {}).get("workerid")
    _WRITES_RUN[0] = worker is None
    _NIGHT_CONFIG[0] = config if worker is None and os.environ.get(PURPOSE_VARIABLE) == "nightly" else None
    gpu = getattr(config, "workerinput", {}).get("kda_gpu")
    if gpu is not None:  # before anything asks CUDA (or HIP) for its devices
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["HIP_VISIBLE_DEVICES"] = gpu
    run = Run(_run_config(config), worker)
    problem = None if worker is not None else run.config.output_problem()
    if problem:
        raise pytest.UsageError(f"--kda-out: {problem}")
    expected = config.getoption("--kda-expected")
    if expected is not None and worker is None:  # read before anything runs: a bad file is a usage error
        try:
            config.stash[EXPECTED] = read_expected(Path(expected))
        except (OSError, ValueError) as exc:
            raise pytest.UsageError(f"--kda-expected: {exc}") from None
    run.config.export()
    config.stash[RUN] = run
    assert run.config.profile is not None
    configure_hypothesis(run.config.profile)
    observe_examples(run.examples)
    # On a CPU the FLA kernels run in Triton's interpreter, which must be switched on
    # before anything imports triton or fla (test modules included).
    if run.config.device.type == "cpu" and not triton_interpret.problem():
        triton_interpret.enable()


def pytest_unconfigure(config: pytest.Config) -> None:
    if SIGTERM_BEFORE in config.stash:
        signal.signal(signal.SIGTERM, config.stash[SIGTERM_BEFORE])
    if RUN in config.stash:
        stop_observing(config.stash[RUN].examples)
    release_claims()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """pytest-xdist, in the controller: each worker gets the run's seed and id, and its GPU."""
    run_config = node.config.stash[RUN].config
    node.workerinput["kda_seed"] = run_config.seed
    node.workerinput["kda_run_id"] = run_config.run_id
    if run_config.device.type == "cuda":
        gpus = chosen_gpus(node.config.getoption("--kda-gpus"))
        if gpus:
            node.workerinput["kda_gpu"] = visible_device(int(node.gateway.id.removeprefix("gw")), gpus)


def _share_cores() -> None:
    """In a pytest-xdist worker, give torch this worker's share of the cores. Each worker would otherwise
    start one thread per core, and on a busy machine every small parallel op waits for a thread that
    another worker's process holds."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def _ran_id(backend_name: str, case: Case) -> str:
    """The test id of the case a test of ``backend_name`` runs: ``case`` moved into the backend's envelope
    (what its records and repro line name), or ``case`` itself where the backend cannot say at collection."""
    try:
        return guard.fit(registry.get(backend_name), case).test_id
    except Exception:  # the test itself records the backend's fault; its id names the drawn case
        return case.test_id


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    run = metafunc.config.stash[RUN]
    backends = list(run.config.backends)
    per_backend = "kda_backend_name" in metafunc.fixturenames
    sources = {
        "first_sweep_case": (run.config.grid.cases, True),
        "long_case": (run.config.long_cases, True),
        "long_backward_case": (run.config.long_backward_cases, True),
        "sentinel": (run.config.sentinel_cases, False),
        "guaranteed_case": (run.config.guaranteed_cases, True),
    }
    fixture = next((name for name in sources if name in metafunc.fixturenames), None)
    chosen = sources[fixture][0]() if fixture else []
    if fixture == "long_backward_case":  # the backends with a backward pass only: no skip line for the others
        backends = _with_a_backward(run)
    if fixture and per_backend and sources[fixture][1]:
        # The id names the case that runs, the one moved into the backend's envelope (what its records and
        # repro line name), the backend first as everywhere (shards read it there).
        pairs = [(b, c) for b in backends for c in chosen]
        metafunc.parametrize(["kda_backend_name", fixture], pairs, ids=[f"{b}-{_ran_id(b, c)}" for b, c in pairs])
        return
    if per_backend:
        metafunc.parametrize("kda_backend_name", backends)
    if fixture:
        metafunc.parametrize(fixture, chosen, ids=[c.test_id for c in chosen])


@pytest.fixture(scope="session")
def kda_run(request: pytest.FixtureRequest) -> Run:
    """The run: its configuration, the truth of its cases, its records and example log."""
    return request.config.stash[RUN]


@pytest.fixture(scope="session")
def kda_device(kda_run: Run) -> torch.device:
    return kda_run.config.device


@pytest.fixture
def kda_backend(kda_run: Run, kda_backend_name: str) -> Backend:
    """The backend under test, able to run on the device; otherwise the test skips, naming what is missing,
    or fails under --kda-strict (KDA_STRICT=1), so a CI job cannot go green by skipping everything."""
    backend = registry.get(kda_backend_name)
    device = kda_run.config.device
    try:
        available = guard.availability(backend, device)
    except BackendFault as fault:  # the test runs, and each of its checks records this error
        kda_run.unanswered[backend.name] = fault
        return backend
    if not available:
        missing = f"{kda_backend_name} cannot run on {device}: {available.reason}"
        if kda_run.config.strict:
            pytest.fail(f"--kda-strict: {missing}", pytrace=False)
        pytest.skip(missing)
    return backend


@pytest.fixture
def kda_record(request: pytest.FixtureRequest, kda_run: Run) -> Callable[[list[Finding]], None]:
    """Adds findings to the run's records (with -v, each record's line as soon as it is measured)."""

    def record(findings: list[Finding]) -> None:
        rows = kda_run.record(findings, request.node.nodeid)
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if request.config.getoption("verbose") > 0 and reporter is not None:
            if not request.config.stash.get(HEADER_SHOWN, False):
                request.config.stash[HEADER_SHOWN] = True
                reporter.write_line(RECORD_LINE_HEADER)
            for row in rows:
                reporter.write_line(record_line(row))

    return record


@pytest.fixture
def kda_checked(
    request: pytest.FixtureRequest, kda_run: Run, kda_record: Callable[[list[Finding]], None]
) -> Callable[[Check, Drawn, Backend], list[Finding]]:
    """Runs a check on a drawn case through the run's executor (``Run.checked``) and records its findings.
    After a sticky device error the case's error is recorded and this process ends: a pytest-xdist worker
    exits and xdist replaces it; a single process stops the session, naming the case."""

    def checked(check: Check, drawn: Drawn, backend: Backend) -> list[Finding]:
        try:
            findings = kda_run.checked(check, drawn, backend, request.node.nodeid)
        except DeviceLost as lost:
            kda_record(lost.findings)
            _end(request.config, str(lost))
        kda_record(findings)
        return findings

    return checked


def _end(config: pytest.Config, message: str) -> NoReturn:
    """End this process after a sticky device error or a hang: a pytest-xdist worker exits and xdist
    replaces it; a single process stops the session."""
    if hasattr(config, "workerinput"):
        sys.stderr.write(f"kda-conformance: {message}\n  this worker ends; pytest-xdist starts another\n")
        sys.stderr.flush()
        os._exit(DEVICE_LOST_EXIT)
    pytest.exit(f"{message}\n  run with pytest-xdist (-n N) so that a fresh worker takes the rest", DEVICE_LOST_EXIT)


def _with_a_backward(run: Run) -> list[str]:
    """The run's backends the gradients check applies to (they declare a backward pass)."""
    device_type = run.config.device.type
    return [b for b in run.config.backends if CHECKS[GRADIENTS].applies(registry.get(b), device_type) is None]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run = config.stash[RUN]
    device = run.config.device
    profile = run.config.profile
    assert profile is not None
    # Profiles without long cases or sentinels: no "empty parameter set" skip lines.
    empty = {"test_long_case"} if not run.config.long_cases() else set()
    empty |= {"test_long_backward"} if not (run.config.long_backward_cases() and _with_a_backward(run)) else set()
    empty |= {"test_sentinel"} if not run.config.sentinel_cases() else set()
    empty |= {"test_guaranteed_case"} if not run.config.guaranteed_cases() else set()
    if empty:
        unused = [item for item in items if getattr(item, "originalname", None) in empty]
        config.hook.pytest_deselected(items=unused)
        items[:] = [item for item in items if item not in unused]
    if run.config.shard is not None:  # this host's share of the tests; the other hosts run the rest
        index = run.config.shard[0]
        plan = run.config.shard_plan([item.nodeid for item in items])
        ours = set(plan.shards[index - 1])
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in ours])
        items[:] = [item for item in items if item.nodeid in ours]
        config.stash[SHARD_LINE] = plan.line(index)
    # Conformance tests run on the chosen device: mark them so `-m cpu` / `-m cuda` select them; a backend's
    # own markers (AITER on a gfx950: `gfx950`) go on its tests.
    marker = "cpu" if device.type == "cpu" else ("rocm" if torch.version.hip else "cuda")
    markers_of: dict[str, tuple[str, ...]] = {}
    seeded: set[int] = set()
    for item in items:
        if item.get_closest_marker("kda_device_dependent"):
            item.add_marker(getattr(pytest.mark, marker))
        name = getattr(getattr(item, "callspec", None), "params", {}).get("kda_backend_name")
        if name is not None:
            if name not in markers_of:
                backend = registry.get(name)
                # A backend that runs interpreted here (FLA's Triton kernels on a CPU) is a tier of its own:
                # `-m interpreter` selects it, `-m "not interpreter"` leaves its seconds-per-call tests out.
                markers_of[name] = (
                    *backend.markers(device),
                    *(("interpreter",) if backend.interpreted(device) else ()),
                )
            for backend_marker in markers_of[name]:
                item.add_marker(getattr(pytest.mark, backend_marker))
        check = getattr(getattr(item, "obj", None), "kda_check", None)
        if check is not None and id(item.obj) not in seeded:  # one test function serves every backend
            seeded.add(id(item.obj))
            item.obj.kda_search(check_seed(check.ci_seed, profile, run.config.seed))
    _corpus_cases_outermost(items)


# The fixtures that hand a test one of the run's planned cases.
CASE_FIXTURES = ("long_case", "long_backward_case", "sentinel", "guaranteed_case")


def _case_of(item: pytest.Item) -> str | None:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "entry" in params:
        return params["entry"].case.id
    case = next((params[name] for name in CASE_FIXTURES if name in params), None)
    return case.id if isinstance(case, Case) else None


def _corpus_cases_outermost(items: list[pytest.Item]) -> None:
    """Corpus and long cases outermost, backends inside: each case's truth (the float64 reference and the
    baseline) is computed once and served to every backend from the run's truth cache."""
    slots = [i for i, item in enumerate(items) if _case_of(item) is not None]
    first_seen: dict[str, int] = {}
    for i in slots:
        first_seen.setdefault(_case_of(items[i]), len(first_seen))
    in_case_order = sorted((items[i] for i in slots), key=lambda item: first_seen[_case_of(item)])
    for i, item in zip(slots, in_case_order, strict=True):
        items[i] = item


def pytest_report_header(config: pytest.Config) -> list[str]:
    run_config = config.stash[RUN].config
    profile = run_config.profile
    assert profile is not None
    how = (
        "derandomized"
        if run_config.seed is None
        else f"seed {run_config.seed} (rerun with --kda-seed {run_config.seed})"
    )
    examples = f"{profile.max_examples} examples per property"
    header = f"kda-conformance: device {run_config.device}, profile {profile.name} ({examples}), {how}"
    replaced = baseline_warning()
    return [header, *run_config.kernel_pool_lines(), *([f"kda-conformance: warning: {replaced}"] if replaced else [])]


def pytest_report_collectionfinish(config: pytest.Config) -> list[str]:
    return [f"kda-conformance: {config.stash[SHARD_LINE]}"] if SHARD_LINE in config.stash else []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each test's wall (setup, call, teardown), in the process that writes the run (the controller of a
    pytest-xdist run, which sees every worker's reports): the run's timing.json keeps it, and a night's
    shards are balanced by it (running/shards.py). A nightly's log names each failed test as it fails."""
    if _WRITES_RUN[0]:  # a worker's reports reach the controller, which counts them
        CLOCK.add_test(report.nodeid, report.duration)
    night = _NIGHT_CONFIG[0]
    terminal = night.pluginmanager.get_plugin("terminalreporter") if report.failed and night is not None else None
    if terminal is not None:
        # Named when it happens, not only in the summary: a night killed from outside (a runner lost, a job's
        # hard limit) writes no summary, and -q's progress says only "F".
        what = "FAILED" if report.when == "call" else f"ERROR in {report.when}"
        terminal.write_line(f"kda-conformance: {what} {report.nodeid}")


def pytest_keyboard_interrupt(excinfo: pytest.ExceptionInfo[BaseException]) -> None:
    """Heard before the session's files are written: a nightly that started this pytest waits for them instead
    of interrupting again (running/interrupts.py)."""
    say_stopping()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the run's files. Each pytest-xdist worker writes its part of the run and hands its stage
    totals (in its part) and example log to the controller, which merges the parts into the run's files; a single
    process writes them itself. One invocation is one run either way."""
    config = session.config
    run = config.stash[RUN]
    if run.config.strict and empty_selection(config, exitstatus) and not hasattr(config, "workerinput"):
        session.exitstatus = pytest.ExitCode.USAGE_ERROR
    complete = exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.NO_TESTS_COLLECTED)
    if hasattr(config, "workeroutput"):
        run.finish(complete, examples=False)  # its part's timing.json carries its stage totals
        config.workeroutput["kda_examples"] = json.dumps(run.examples.entries)
    else:  # the process that writes the run's files: a night's compile stage goes in with its own totals
        CLOCK.add_night_compile_stage()
        if config.pluginmanager.getplugin("dsession") is not None:
            config.stash[WRITTEN] = run.merge_workers(complete)
        else:
            config.stash[WRITTEN] = run.finish(complete) if (run.rows or run.examples.entries) else {}
    if not hasattr(config, "workerinput") and run.config.strict and run.frame is not None:
        if not stale_known_issues(run.frame).empty and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED  # --kda-strict: a retired issue must leave the ledger
    if EXPECTED in config.stash and config.stash.get(WRITTEN, None):  # the controller, once the run is in the store
        config.stash[DEPARTED] = tonight_departures(load_store(run.config.out), config.stash[EXPECTED])
        if config.stash[DEPARTED] and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if not hasattr(config, "workerinput") and not_checked(run) and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = NOT_CHECKED_EXIT  # a case never judged is no pass (as kda-conformance's exit 4)
    _EXIT_STATUS[0] = int(session.exitstatus)
    if not hasattr(config, "workerinput") and session.exitstatus:
        # Registered last, so run first at exit: a handler a backend registered (atexit.register(os._exit, 0))
        # cannot turn a failed session into a green exit. The handlers registered before it do not run then.
        atexit.register(flush_and_exit, int(session.exitstatus))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """pytest-xdist, in the controller: a worker's example log joins the run's (its stage totals come
    with its part of the run, which an interrupted night still writes)."""
    output = getattr(node, "workeroutput", {})
    if "kda_examples" in output:
        node.config.stash[RUN].examples.entries.update(json.loads(output["kda_examples"]))
