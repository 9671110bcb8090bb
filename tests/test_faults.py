"""Real faults cost one case: a sticky device error (simulated on the CPU: the message CUDA gives), running
out of memory; one invocation is one run, over pytest-xdist workers and over hosts (shards)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from suite_paths import ENV, PLUGINS, REPO, import_plugin, pytest_run

from kda_cases.case import Case
from kda_cases.grids import first_sweep_cases
from kda_conformance.checks import Drawn, get_check
from kda_conformance.checks._tests import check_report
from kda_conformance.cli import main
from kda_conformance.cli.exits import ERRORED
from kda_conformance.running.config import build_config
from kda_conformance.running.faults import DEVICE_LOST_EXIT, DeviceLost, is_sticky
from kda_conformance.running.memory import SHARES, memory_shares, shares_for, visible_device
from kda_conformance.running.option_values import parse_shard
from kda_conformance.running.run import Run
from kda_kernels import registry
from kda_reports.regressions import find_regressions
from kda_reports.store import load_store

CORPUS_CASES = "kda-7735f63ee3cc or kda-cb6cc21512bb or kda-4b573c63b5b6"  # three short corpus cases


@pytest.fixture(scope="module", autouse=True)
def planted_crashes() -> None:
    import_plugin("kda_planted_crashes")  # registers the failing backends


def test_sticky_device_errors_are_told_from_other_errors() -> None:
    for message in (
        "CUDA error: an illegal memory access was encountered",
        "HIP error: hipErrorIllegalAddress",
        "CUDA error: device-side assert triggered",
        "CUDA error: unspecified launch failure",
    ):
        assert is_sticky(RuntimeError(message)), message
    assert not is_sticky(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_sticky(ValueError("shapes do not match"))


@pytest.mark.slow
def test_a_sticky_error_in_a_worker_costs_its_cases_only(tmp_path: Path) -> None:
    done = pytest_run(
        "conformance/test_corpus.py",
        "-n",
        "2",
        "--max-worker-restart",
        "8",
        "-k",
        CORPUS_CASES,
        "--kda-plugin",
        "kda_planted_crashes",
        "--kda-backend",
        "planted_sticky_fault",
        "--kda-backend",
        "torch_chunk",
        "--kda-out",
        str(tmp_path),
    )
    assert done.returncode == 1, done.stdout[-3000:]
    store = load_store(tmp_path)
    assert len(store.runs) == 1 and not store.problems, store.problems
    by_backend = dict(iter(store.records.groupby("backend")))
    assert set(by_backend["torch_chunk"]["verdict"]) == {"pass"} and by_backend["torch_chunk"]["case_id"].nunique() == 3
    sticky = by_backend["planted_sticky_fault"]
    assert set(sticky["verdict"]) == {"error"} and sticky["case_id"].nunique() == 3
    assert sticky["reason"].str.contains("illegal memory access").all()
    plugin = f"--plugin {(PLUGINS / 'kda_planted_crashes.py').resolve()}"
    assert (
        sticky["repro"]
        .str.startswith(f"kda-conformance run --device cpu {plugin} --backend planted_sticky_fault")
        .all()
    )
    assert "crashed while running" in done.stdout  # pytest-xdist replaced the worker and went on


@pytest.mark.slow
def test_a_configuration_that_crashed_is_launched_once_a_night(tmp_path: Path) -> None:
    """The first sweep's bf16 cases of 64 and 130 tokens fall in two kernel configurations (with and without an
    initial state); a backend that crashes on bf16 is launched once per configuration, its later cases of
    each recorded as quarantined (ending no worker), its fp32 cases untouched. Two cases of one configuration
    on two workers can both crash before either crash is recorded: see the comment below."""
    log = tmp_path / "launches.log"
    done = pytest_run(
        "conformance/test_first_sweep.py",
        "-k",
        "T64 or T130",  # 8 cases: 4 bf16 in 2 kernel configurations (with and without h0), 4 fp32
        # One worker, restarted after each crash: two workers could each start a case of the same
        # configuration before either crash is recorded (a race the quarantine cannot close), so the
        # count of launches would depend on timing.
        "-n",
        "1",
        "--max-worker-restart",
        "8",
        "--kda-plugin",
        "kda_planted_crashes",
        "--kda-backend",
        "planted_bf16_crash",
        "--kda-out",
        str(tmp_path / "store"),
        env={**ENV, "KDA_LAUNCH_LOG": str(log)},
    )
    assert done.returncode == 1, done.stdout[-3000:]
    launched_bf16 = [line.split()[0] for line in log.read_text().splitlines() if line.endswith("bf16")]
    # a quarantined case crashes nothing; counted in the failures section, since pytest repeats each message in
    # its short summary when it sees a CI environment (CI=1) and cuts it to the terminal's width otherwise
    failures = done.stdout.split("short test summary info")[0]
    assert failures.count("crashed while running") == 2, done.stdout[-3000:]
    records = load_store(tmp_path / "store").records
    reasons = records["reason"].fillna("")
    quarantined = records[reasons.str.startswith("quarantined after")]
    crashed = records[reasons.str.contains("misaligned address") & ~reasons.str.startswith("quarantined")]
    assert len(launched_bf16) == len(set(launched_bf16)) == 2, log.read_text()
    assert set(crashed["case_id"]) == set(launched_bf16)
    assert quarantined["case_id"].nunique() == 2 and set(quarantined["verdict"]) == {"error"}
    assert quarantined["reason"].str.contains("not launched").all()
    assert set(quarantined["case_id"]).isdisjoint(launched_bf16)
    sweep = first_sweep_cases()
    fp32 = {c.id for c in sweep if c.dtype == "fp32" and c.max_len in (64, 130)}
    assert set(records[records["verdict"] == "pass"]["case_id"]) == fp32, records[["case_id", "verdict", "reason"]]


@pytest.mark.slow
def test_without_xdist_a_sticky_error_stops_the_session_naming_the_case(tmp_path: Path) -> None:
    done = pytest_run(
        "conformance/test_corpus.py",
        "-k",
        "kda-7735f63ee3cc",
        "--kda-plugin",
        "kda_planted_crashes",
        "--kda-backend",
        "planted_sticky_fault",
        "--kda-backend",
        "torch_chunk",
        "--kda-out",
        str(tmp_path),
    )
    assert done.returncode == DEVICE_LOST_EXIT, done.stdout[-3000:]
    assert "sticky device error in budget of kda-7735f63ee3cc on planted_sticky_fault" in done.stdout
    records = load_store(tmp_path).records
    assert list(records["verdict"]) == ["error"] and list(records["backend"]) == ["planted_sticky_fault"]


@pytest.mark.slow
def test_the_sweep_stops_on_a_sticky_error_and_isolated_cases_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))  # the isolated case processes start from this sys.path
    cases = [arg for case in ('{"seq_lens": [37]}', '{"seq_lens": [64], "dtype": "fp32"}') for arg in ("--case", case)]
    backends = ["--backend", "planted_sticky_fault", "--backend", "torch_chunk"]
    common = ["run", "--device", "cpu", "--plugin", "kda_planted_crashes", *backends, *cases, "--no-dashboard"]
    assert main([*common, "--out", str(tmp_path / "one")]) == ERRORED  # nothing failed: one backend erred
    stopped = load_store(tmp_path / "one").records
    assert list(stopped["verdict"]) == ["error"] and not stopped["env_complete"].any()
    assert main([*common, "--isolate", "--out", str(tmp_path / "isolated")]) == ERRORED
    isolated = load_store(tmp_path / "isolated").records
    assert set(isolated[isolated["backend"] == "torch_chunk"]["verdict"]) == {"pass"}
    assert (isolated[isolated["backend"] == "planted_sticky_fault"]["verdict"] == "error").sum() == 2


def _hold_shares(folder: str, count: int, log: str) -> None:
    with memory_shares(Path(folder), count):
        start = time.monotonic()
        time.sleep(0.6)
        Path(log).write_text(f"{start} {time.monotonic()}")


def _spans(tmp_path: Path, counts: tuple[int, int]) -> list[tuple[float, float]]:
    context = multiprocessing.get_context("fork")
    logs = [tmp_path / f"span-{i}" for i in range(len(counts))]
    workers = [
        context.Process(target=_hold_shares, args=(str(tmp_path / "gpu"), n, str(log)))
        for n, log in zip(counts, logs, strict=True)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    return [tuple(map(float, log.read_text().split())) for log in logs]


def test_gpu_memory_shares_let_cases_run_side_by_side_while_they_fit(tmp_path: Path) -> None:
    (a0, a1), (b0, b1) = _spans(tmp_path / "fit", (SHARES // 2, SHARES // 2))
    assert a0 < b1 and b0 < a1, "two halves of the GPU run at once"
    (c0, c1), (d0, d1) = _spans(tmp_path / "apart", (SHARES // 2 + 1, SHARES // 2 + 1))
    assert c1 <= d0 or d1 <= c0, "two cases that need more than the GPU between them run one after the other"
    with pytest.raises(ValueError, match=f"count must be 1 to {SHARES}, got 0"):
        with memory_shares(tmp_path / "gpu", 0):
            pass


def test_a_case_takes_shares_in_proportion_to_its_size() -> None:
    def shares(tokens: int, heads: int) -> int:
        case = Case(seq_lens=(tokens,), num_heads=heads, num_v_heads=heads, head_k_dim=128, head_v_dim=128)
        return shares_for(case, device_gib=139.8)  # an H200

    assert shares(100, 2) == shares(16384, 16) == 1
    assert 1 < shares(131072, 8) < shares(131072, 16) < shares(262144, 16) <= SHARES


def test_out_of_memory_is_retried_alone_and_then_a_resource_outcome(tmp_path: Path) -> None:
    run = Run(build_config(device="cpu", backends=["torch_chunk"], out=tmp_path))
    case = Case(seq_lens=(37,))

    def budget(name: str) -> list:
        backend = registry.get(name)
        return run.checked(get_check("budget"), Drawn(case), backend)

    assert {f.verdict for f in budget("planted_oom_once")} == {"pass"}
    [resource] = budget("planted_oom_always")
    assert resource.verdict == "resource" and not resource.failed
    assert (
        resource.reason.startswith("out of memory: needed 1.50 GiB more") and "alone on the device" in resource.reason
    )
    # A kernel's own text, or an allocation past the whole device, is the kernel's error: never a resource
    # outcome, which would leave a kernel that produced nothing looking like one the machine stopped.
    for name, said in (("planted_oom_past_the_device", "16.00 TiB"), ("planted_says_out_of_memory", "bad tile")):
        [error] = budget(name)
        assert error.verdict == "error" and said in error.reason, error
    check = get_check("prefix")

    def raises(truth, backend, params, judge):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(DeviceLost) as lost:
        run.checked(dataclasses.replace(check, run=raises), Drawn(case, {"at": 5}), registry.get("torch_chunk"))
    [error] = lost.value.findings
    assert error.verdict == "error" and "--check prefix" in error.repro and "--at 5" in error.repro


def test_a_sticky_error_raised_when_the_case_gives_its_memory_back_is_still_that_cases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU a dead context shows again when the case gives its allocator's cache back (seen on the
    H200: that error escaped the guard, the worker went on, and 368 later tests failed with it)."""
    from kda_conformance.running import run as executor

    run = Run(build_config(device="cpu", backends=["torch_chunk"], out=tmp_path))
    case, backend = Case(seq_lens=(37,)), registry.get("torch_chunk")

    def release_on_a_dead_context(device: torch.device) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(executor, "release_cached_memory", release_on_a_dead_context)
    # The kernel's fault surfaced only at the release: charged to this case and backend, and the worker ends.
    with pytest.raises(DeviceLost) as lost:
        run.checked(get_check("budget"), Drawn(case), backend)
    [error] = lost.value.findings
    assert error.verdict == "error" and error.backend == "torch_chunk" and is_sticky(error.reason)

    # The kernel raised it itself: the error keeps the kernel's own place, not the release's (a fresh run: the
    # first one quarantined the case's kernel configuration on this backend, as a night does).
    run = Run(build_config(device="cpu", backends=["torch_chunk"], out=tmp_path))

    def kernel_fault(truth, backend, params, judge):
        raise RuntimeError("CUDA error: misaligned address")

    with pytest.raises(DeviceLost) as lost:
        run.checked(dataclasses.replace(get_check("budget"), run=kernel_fault), Drawn(case), backend)
    [error] = lost.value.findings
    assert "misaligned address" in error.reason and "release_on_a_dead_context" not in error.reason


@pytest.mark.slow
def test_one_invocation_over_workers_is_one_run_and_a_new_failure_in_it_is_flagged(tmp_path: Path) -> None:
    args = ["conformance/test_first_sweep.py", "-n", "2", "--kda-plugin", "kda_planted_crashes"]
    args += ["--kda-backend", "planted_fails_when_told", "--kda-lengths", "37,40", "--kda-out", str(tmp_path)]
    for night, fail in enumerate(("0", "0", "1")):
        done = pytest_run(*args, env={**ENV, "KDA_PLANTED_FAIL": fail})
        assert done.returncode == (1 if fail == "1" else 0), done.stdout[-2000:]
        assert len(load_store(tmp_path).runs) == night + 1, "each invocation is one run, whatever its workers"
    store = load_store(tmp_path)
    assert store.records.groupby("run_id")["case_id"].nunique().tolist() == [9, 9, 9]
    flags = find_regressions(store.records, store.runs)
    assert set(flags["kind"]) == {"new failure"} and set(flags["backend"]) == {"planted_fails_when_told"}
    assert all(family.startswith("fp32 ") for family in flags["family"])


@pytest.mark.slow
def test_shards_split_the_tests_and_the_store_merges_them_into_one_run(tmp_path: Path) -> None:
    assert parse_shard("2/4") == (2, 4)
    for bad in ("0/4", "5/4", "two"):
        with pytest.raises(ValueError, match="shard must be I/N"):
            parse_shard(bad)
    configs = [build_config(device="cpu", shard=f"{i}/3", run_id="night-1") for i in (1, 2, 3)]
    names = [f"conformance/test_corpus.py::test_corpus_case[{b}-{n}]" for n in range(20) for b in "abc"]
    plans = [c.shard_plan(names) for c in configs]
    assert plans[0] == plans[1] == plans[2], "every host makes the same plan"
    owners = [[name in shard for shard in plans[0].shards].count(True) for name in names]
    assert owners == [1] * len(names), "every test belongs to exactly one shard"
    assert configs[0].seed == configs[2].seed, "the shards of one run draw from one seed"
    common = ["conformance/test_first_sweep.py", "--kda-backend", "torch_chunk", "--kda-lengths", "37,40"]
    common += ["--kda-run-id", "night-1", "--kda-out", str(tmp_path)]
    for shard in ("1/2", "2/2"):
        done = pytest_run(*common, "--kda-shard", shard)
        assert done.returncode in (0, 5), done.stdout[-2000:]
    store = load_store(tmp_path)
    assert list(store.runs["run_id"]) == ["night-1"] and store.records["case_id"].nunique() == 9
    # What a run records of its command is the same on every machine: no output folder, no checkout path.
    assert set(store.records["env_command"]) == {
        "pytest -q -p no:randomly --kda-device cpu conformance/test_first_sweep.py --kda-backend torch_chunk "
        f"--kda-lengths 37,40 --kda-run-id night-1 "
        f"--kda-shard {shard}"
        for shard in ("1/2", "2/2")
    }
    # One backend, heavier than half the night: its tests are split over both shards.
    assert set(store.records["env_shard"]) == {"1/2", "2/2"}
    tests = [json.loads((tmp_path / "runs" / f"night-1.s{i}of2.timing.json").read_text())["tests"] for i in (1, 2)]
    assert len(tests[0]) + len(tests[1]) == 9 and not tests[0].keys() & tests[1].keys()
    assert all(seconds > 0 for part in tests for seconds in part.values())


def test_workers_spread_over_the_gpus_round_robin() -> None:
    assert [visible_device(i, ["0", "1"]) for i in range(5)] == ["0", "1", "0", "1", "0"]
    assert visible_device(3, ["2"]) == "2"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (the H200 pair host)")
def test_two_gpus_take_half_the_workers_each(tmp_path: Path) -> None:
    done = pytest_run("conformance/test_first_sweep.py", "-n", "4", "--kda-device", "cuda", "--kda-out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:]
    records = load_store(tmp_path).records
    assert set(records["env_visible_devices"]) == {"0", "1"}
    assert isinstance(records, pd.DataFrame)


@pytest.mark.slow
def test_a_hung_case_in_a_worker_costs_that_case_only(tmp_path: Path) -> None:
    done = pytest_run(
        "conformance/test_corpus.py",
        "-n",
        "2",
        "-k",
        "kda-7735f63ee3cc or kda-cb6cc21512bb",
        "--kda-case-timeout",
        "5",
        "--kda-plugin",
        "kda_planted_crashes",
        "--kda-backend",
        "planted_hang",
        "--kda-backend",
        "torch_chunk",
        "--kda-out",
        str(tmp_path),
    )
    assert done.returncode == 1, done.stdout[-3000:]
    records = load_store(tmp_path).records
    hung = records[records["backend"] == "planted_hang"]
    assert set(hung["verdict"]) == {"error"} and hung["case_id"].nunique() == 2
    assert hung["reason"].str.startswith("no result within 5 s (hung or too slow)").all()
    assert set(records[records["backend"] == "torch_chunk"]["verdict"]) == {"pass"}


@pytest.mark.slow
def test_an_interrupted_night_keeps_its_workers_stage_times(tmp_path: Path, interruptible: dict) -> None:
    """A CI job's time limit (SIGTERM to every process, as `timeout` sends it; Ctrl-C's SIGINT is the
    dashboard's interrupted-night test) on pytest -n: the merged run still says where the workers' time went
    (on the H200 an interrupted night's timing.json held zeros), and the call the interrupt cut short is
    nobody's error (a night cut by `timeout` on the H200 charged 12 calls in flight to their kernels as "the
    process ended during the call")."""
    # One worker: torch_chunk's case, then the planted hang on the same case (tests go case by case, in the
    # order the backends are given), which holds the worker until the interrupt.
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "--kda-device", "cpu", "-n", "1"]
    command += ["conformance/test_corpus.py", "-k", "kda-4b573c63b5b6", "--kda-plugin", "kda_planted_crashes"]
    command += ["--kda-backend", "torch_chunk", "--kda-backend", "planted_hang", "--kda-run-id", "cut-short"]
    command += ["--kda-out", str(tmp_path)]
    process = subprocess.Popen(
        command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **interruptible
    )
    try:
        deadline = time.monotonic() + 300
        # A record of torch_chunk's (not the journal's marker of its call in flight, which names it too).
        while not any('"verdict": "pass"' in p.read_text() for p in (tmp_path / "runs").glob("*gw*.partial.jsonl")):
            assert process.poll() is None and time.monotonic() < deadline, "no worker recorded a case"
            time.sleep(0.5)
        time.sleep(1)  # the worker is in the planted hang's call now
        os.killpg(process.pid, signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    timing = json.loads((tmp_path / "runs" / "cut-short.timing.json").read_text())
    assert timing["calls"]["backend"] > 0 and timing["seconds"]["reference"] > 0, output[-2000:]
    records = load_store(tmp_path).records
    assert "planted_hang" not in set(records.loc[records["verdict"] == "error", "backend"]), output[-2000:]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="an out-of-bounds Triton kernel needs a GPU")
def test_an_out_of_bounds_kernel_on_a_gpu_costs_its_cases_only(tmp_path: Path) -> None:
    """A real illegal address on a real GPU, beside FLA's kernels and the baseline, which keep passing."""
    backends = ["planted_oob_write", "fla_chunk", "fla_recurrent", "torch_chunk"]
    done = pytest_run(
        "conformance/test_corpus.py",
        "--kda-device",
        "cuda",
        "-n",
        "4",
        "--max-worker-restart",
        "20",
        "-k",
        CORPUS_CASES,
        "--kda-plugin",
        "kda_planted_gpu_faults",
        *(arg for name in backends for arg in ("--kda-backend", name)),
        "--kda-out",
        str(tmp_path),
    )
    assert done.returncode == 1, done.stdout[-3000:]
    records = load_store(tmp_path).records
    planted = records[records["backend"] == "planted_oob_write"]
    assert set(planted["verdict"]) == {"error"} and planted["case_id"].nunique() == 3
    assert planted["reason"].str.contains("illegal memory access").all()
    others = records[records["backend"] != "planted_oob_write"]
    assert set(others["verdict"]) == {"pass"} and others.groupby("backend")["case_id"].nunique().to_dict() == {
        name: 3 for name in backends[1:]
    }


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux: /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _cmdline(pid: int) -> str:
    """``pid``'s command line, or "" once it has exited (short-lived children come and go while we look)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc (Linux)")
def test_an_isolated_worker_dies_with_its_killed_parent(tmp_path: Path) -> None:
    """SIGKILL of the sweep while its worker hangs in a kernel: the worker must not live on (on a GPU it would
    hold the device)."""
    command = [sys.executable, "-m", "kda_conformance.cli", "run", "--device", "cpu", "--isolate"]
    command += ["--plugin", "kda_planted_crashes", "--backend", "planted_hang", "--case", '{"seq_lens": [37]}']
    command += ["--out", str(tmp_path), "--no-dashboard"]
    sweep = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not workers and time.monotonic() < deadline:
            time.sleep(0.5)
            workers = [p for p in _children(sweep.pid) if "spawn_main" in _cmdline(p)]
        assert workers, "the sweep started no worker process"
        time.sleep(3)  # the worker is in the hanging backend now
        sweep.kill()
        sweep.wait(30)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in workers), "the worker outlived its killed parent"
    finally:
        sweep.kill()
        # A killed sweep's workers are no longer its children; a pid that exited may be reused, hence the check.
        for pid in {*workers, *_children(sweep.pid)}:
            if "spawn_main" in _cmdline(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)


def test_an_invalid_case_is_the_suites_error_not_the_backends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kda_conformance.judging.tolerance import InvalidTruth
    from kda_conformance.running import truth

    def invalid(case: Case, *args: object) -> dict:
        raise InvalidTruth(f"case {case.id}: the float64 truth's o holds 3 non-finite values")

    monkeypatch.setattr(truth, "case_budgets", invalid)
    run = Run(build_config(device="cpu", backends=["torch_chunk"], out=tmp_path))
    backend = registry.get("torch_chunk")
    [finding] = run.checked(get_check("budget"), Drawn(Case(seq_lens=(37,))), backend)
    assert finding.verdict == "error" and finding.backend == "(suite)"
    assert finding.reason.startswith("invalid case (not torch_chunk's error): case kda-")


def test_workers_per_gpu_come_from_its_memory_and_the_largest_case() -> None:
    from kda_cases.grids import long_cases
    from kda_conformance.running.memory import CONTEXT_GIB, TRUTH_CACHE_GIB, USABLE, expected_gib, plan_workers

    long = long_cases(("bf16",), 131072, 1)
    h200 = plan_workers(139.8, 1, long)
    assert h200.workers_per_gpu == 16 and h200.largest == long[0]
    small = plan_workers(48.0, 2, long)
    # Every worker's context and truth cache beside the shares, which still hold the largest case.
    per_worker = CONTEXT_GIB + TRUTH_CACHE_GIB
    assert USABLE * 48.0 - small.workers_per_gpu * per_worker >= expected_gib(long[0])
    assert USABLE * 48.0 - (small.workers_per_gpu + 1) * per_worker < expected_gib(long[0])
    assert small.workers == 2 * small.workers_per_gpu and "workers per GPU x 2 GPU(s)" in small.line()
    assert shares_for(long[0], 48.0, small.workers_per_gpu) <= SHARES
    assert plan_workers(expected_gib(long[0]) / 2, 1, long).workers_per_gpu == 1  # never none, even too small


def test_workers_per_gpu_are_those_that_run_the_most_cases_at_once() -> None:
    """On an H100 with small cases 16 workers shrank the shares until the smallest case took 4 of them: 4 cases
    ran at once and 12 workers waited; the plan takes 12, whose shares hold 12 of them."""
    from kda_conformance.running.memory import at_once, plan_workers

    h100 = 79.19
    small = [Case(seq_lens=(2049,), num_heads=2, num_v_heads=2, head_k_dim=32, head_v_dim=32, dtype="fp32")]
    plan = plan_workers(h100, 1, small)
    assert at_once(h100, 16) == 4 and plan.workers_per_gpu == 12 and at_once(h100, 12) == 12
    assert "16 shares of 1.2 GiB, up to 12 small cases at once" in plan.line()
    assert all(at_once(h100, workers) < 12 for workers in range(13, 17))  # more workers, fewer at once
    assert plan.compile_processes == 16  # compiling holds no shares: every process the memory holds
    # Where more workers do run more at once (an H200), the plan keeps them all; with the nightly profile's
    # largest case (23.4 GiB) the memory holds 10 on the H100, and those 10 run at once, as before.
    assert plan_workers(139.8, 1, small).workers_per_gpu == 16 and at_once(139.8, 16) == 16
    longest = Case(seq_lens=(131072,), num_heads=16, num_v_heads=16, head_k_dim=128, head_v_dim=128)
    night = plan_workers(h100, 1, [*small, longest])
    assert night.workers_per_gpu == night.fitting_per_gpu == 10 and at_once(h100, 10) == 10


@pytest.mark.slow
def test_the_compile_stage_runs_each_job_once_and_goes_on_after_a_crash(tmp_path: Path, monkeypatch) -> None:
    """A configuration whose compile leaves the device context dead ends its process; the jobs after it go on
    in a new one, and each job has one result."""
    from kda_cases.case import Case
    from kda_conformance.running.compile import compile_jobs, run_jobs, summary

    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    configs = [Case(seq_lens=(37,)), Case(seq_lens=(37,), dtype="fp32"), Case(seq_lens=(37,), dtype="fp16")]
    jobs = compile_jobs(["planted_bf16_crash", "torch_chunk"], configs)
    results = run_jobs(jobs, 1, "cpu", ["kda_planted_crashes"], tmp_path)
    outcome = {(r["backend"], r["config"].split()[3]): r["outcome"] for r in results}
    assert len(results) == len(jobs) == 6
    assert outcome.pop(("planted_bf16_crash", "bf16")) == "failed"
    assert set(outcome.values()) == {"compiled"}, results
    assert len(list(tmp_path.glob("compile-0-*.jobs.json"))) == 2  # the crash cost one new process
    totals = summary(results, 1.0)
    assert totals["jobs"] == 6 and totals["outcomes"] == {"failed": 1, "compiled": 5}


@pytest.mark.slow
def test_a_configuration_whose_compile_crashed_is_quarantined_before_the_cases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The night's compile stage meets the crash first: the cases of the crashing configuration are recorded as
    quarantined errors (each with its own repro), and the backend is not launched for them."""
    from rich.console import Console

    from kda_conformance.cli.nightly import _quarantine_crashes
    from kda_conformance.running.compile import compile_jobs, run_jobs

    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    config = build_config(device="cpu", backends=["planted_bf16_crash"], out=tmp_path)
    bf16, fp32 = Case(seq_lens=(37,)), Case(seq_lens=(37,), dtype="fp32")
    jobs = compile_jobs(["planted_bf16_crash"], [bf16, fp32])
    results = run_jobs(jobs, 1, "cpu", ["kda_planted_crashes"], tmp_path / "compile")
    console = Console(record=True, width=200)
    _quarantine_crashes(config, jobs, results, console)
    assert "quarantined: planted_bf16_crash H2/2 K64 V64 bf16" in console.export_text()

    log = tmp_path / "launches.log"
    monkeypatch.setenv("KDA_LAUNCH_LOG", str(log))
    run, backend = Run(config), registry.get("planted_bf16_crash")
    later = Case(seq_lens=(130,), seed=5)  # another case of the crashed configuration
    [error] = run.checked(get_check("budget"), Drawn(later), backend)
    assert error.verdict == "error" and error.reason.startswith(f"quarantined after {jobs[0].case.id} (compile)")
    assert "--backend planted_bf16_crash" in error.repro and '"seq_lens": [130]' in error.repro
    assert {f.verdict for f in run.checked(get_check("budget"), Drawn(fp32), backend)} == {"pass"}
    assert [line.split()[1] for line in log.read_text().splitlines()] == ["fp32"]  # the bf16 case never launched


def test_a_shard_compiles_the_configurations_of_its_own_tests() -> None:
    from kda_cases.case import Case
    from kda_conformance.running.compile import shard_jobs

    corpus = [Case(seq_lens=(37,)), Case(seq_lens=(64,), dtype="fp32"), Case(seq_lens=(65,), dtype="fp16")]
    pool = [Case(seq_lens=(100,), num_heads=4, num_v_heads=4), Case(seq_lens=(10,), head_k_dim=32)]
    nodeids = [
        f"conformance/test_corpus.py::test_corpus_case[fla_chunk-{corpus[0].test_id}]",
        f"conformance/test_corpus.py::test_corpus_case[torch_chunk-{corpus[1].test_id}]",
        f"conformance/test_corpus.py::test_corpus_case[fla_chunk-{corpus[1].test_id}]",
        "conformance/test_properties.py::test_within_budget[fla_recurrent]",
        "conformance/test_properties.py::test_prefix_outputs_ignore_later_tokens[fla_recurrent]",
    ]
    jobs = shard_jobs(nodeids, corpus, pool)
    pairs = {(job.backend, job.case.dtype, job.case.num_heads, job.case.head_k_dim) for job in jobs}
    assert pairs == {
        ("fla_chunk", "bf16", 2, 64),
        ("fla_chunk", "fp32", 2, 64),
        ("torch_chunk", "fp32", 2, 64),
        ("fla_recurrent", "bf16", 4, 64),
        ("fla_recurrent", "bf16", 2, 32),
    }
    assert len(jobs) == 5 and all(job.case.max_len == 70 for job in jobs)  # short cases of each configuration


@pytest.mark.slow
def test_compile_only_runs_the_stage_alone_and_writes_the_night_file(tmp_path: Path) -> None:
    """``--compile only``: the compile stage as ``on`` runs it (here forced on the CPU), its night file, and no
    tests, to warm a host's cache or time the stage with and without autotune replay."""
    argv = ["nightly", "--store", str(tmp_path), "--device", "cpu", "--backend", "torch_chunk", "--profile", "smoke"]
    assert main([*argv, "--compile", "only", "--run-id", "c1", "--workers", "1"]) == 0
    night = json.loads((tmp_path / "runs" / "c1.night.json").read_text())
    assert night["compile_only"] is True and night["compile"]["jobs"] > 0
    assert night["compile"]["outcomes"].keys() <= {"compiled", "skipped"}, night["compile"]["outcomes"]
    assert not (tmp_path / "runs" / "c1.parquet").exists(), "no tests ran"


def test_a_long_case_gets_a_warm_up_of_its_own_size_class() -> None:
    """On a cold H200 one call of sglang_chunk on a 128K-token fp32 case took 184 s: SGLang's kernels choose
    their path by the grid and chunk count, and the 70-token warm-up had compiled the small-grid path only."""
    from kda_cases.kernel_configs import SMALLEST, size_class, size_label, warm_up_case
    from kda_conformance.running.compile import compile_jobs

    short, long = Case(seq_lens=(37,), num_heads=4, num_v_heads=8), Case(seq_lens=(131072,), num_heads=4, num_v_heads=8)
    packed = Case(seq_lens=(2047, 2048, 2049), packed=True, num_heads=8, num_v_heads=8)
    jobs = compile_jobs(["torch_chunk"], [short, long, short.replace(seed=5), packed])
    # The larger classes first (the stage's longest jobs); the seed is no new job.
    assert [job.case.seq_lens for job in jobs] == [(8198,), (1990, 0, 33), (70,)]
    assert [size_class(job.case) for job in jobs] == [(2, True), (1, True), SMALLEST]
    assert jobs[0].key.endswith("(129+ chunks, grid > 256)") and "(" not in jobs[2].key.split("safe")[-1]
    assert size_class(long) == size_class(jobs[0].case) and size_label(SMALLEST) == ""
    # Many heads reach a large grid in a few chunks; a [B, T] batch keeps its rows where they make the grid.
    wide = Case(seq_lens=(300, 300, 300, 300), num_heads=16, num_v_heads=16)
    assert warm_up_case(wide).seq_lens == (262,) * 4 and size_class(warm_up_case(wide)) == size_class(wide)


@pytest.mark.slow
def test_a_compile_stage_cut_by_its_budget_skips_what_it_did_not_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--compile-budget: past it the stage stops; the jobs it did not finish (one hanging mid-job) are "not
    compiled", not crashes; their cases skip saying so, the compiled ones run. Progress is said as it goes."""
    from rich.console import Console

    from kda_conformance.cli.nightly import _quarantine_crashes, _skip_uncompiled
    from kda_conformance.running.compile import CUT, Progress, compile_jobs, run_jobs

    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    case = Case(seq_lens=(37,))
    jobs = compile_jobs(["torch_chunk", "planted_hang"], [case])
    lines: list[str] = []
    results = run_jobs(jobs, 1, "cpu", ["kda_planted_crashes"], tmp_path / "compile", timeout_s=25,
                       progress=Progress(lines.append, every=0))  # fmt: skip
    assert {r["backend"]: r["outcome"] for r in results} == {"torch_chunk": "compiled", "planted_hang": CUT}
    assert "the compile stage was cut at 25 s" in results[1]["message"]
    assert lines[0].startswith("compile stage: 0/2 jobs") and any("1/2 jobs" in line for line in lines), lines
    assert any("torch_chunk 1" in line and "slowest torch_chunk" in line and "s left" in line for line in lines)

    config = build_config(device="cpu", backends=["torch_chunk", "planted_hang"], out=tmp_path)
    console = Console(record=True, width=200)
    _quarantine_crashes(config, jobs, results, console)
    _skip_uncompiled(config, jobs, results, console)
    said = console.export_text()
    assert "quarantined" not in said and "1 (backend, configuration) jobs not compiled" in said, said
    run = Run(config)
    [skip] = run.checked(get_check("budget"), Drawn(case.replace(seed=3)), registry.get("planted_hang"))
    assert skip.verdict == "skip" and skip.reason.startswith("not compiled: the compile stage was cut at 25 s")
    # A drawn example of such a configuration is recorded, not failed (on the H200 it failed as "raised
    # Unsupported", the check's failure for a backend that refuses a case drawn inside its envelope).
    assert skip.observed == "not launched" and check_report(get_check("budget"), [skip], {}, config.fails) is None
    assert {f.verdict for f in run.checked(get_check("budget"), Drawn(case), registry.get("torch_chunk"))} == {"pass"}


def test_the_nights_compile_jobs_are_each_backends_own_configurations() -> None:
    """A night's configurations moved into each backend's envelope, as its tests move them: on the H200 the
    whole-night stage planned FlashKDA's jobs at fp16 and K = 32, which it never runs (42 of 234 jobs skipped)."""
    from kda_conformance.running.compile import compile_jobs

    narrow, wide = Case(seq_lens=(37,), dtype="fp16", head_k_dim=32, head_v_dim=32), Case(seq_lens=(37,))
    jobs = compile_jobs(["torch_chunk", "flashkda_cuda"], [narrow, wide])
    flashkda = [job.case for job in jobs if job.backend == "flashkda_cuda"]
    assert len(flashkda) == 1 and (flashkda[0].dtype, flashkda[0].head_k_dim) == ("bf16", 128)
    assert len([job for job in jobs if job.backend == "torch_chunk"]) == 2


def test_an_interrupted_compile_stage_says_and_keeps_what_it_compiled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the H200 a shard interrupted in its compile stage at 556 s said only "interrupted" and kept nothing."""
    from kda_conformance.cli import nightly
    from kda_conformance.running.compile import StageInterrupted

    done = [{"backend": "torch_chunk", "config": "c", "outcome": "compiled", "seconds": 2.0, "message": ""}]

    def interrupted(*args, **kwargs):
        raise StageInterrupted(done)

    monkeypatch.setattr(nightly, "run_jobs", interrupted)
    argv = ["nightly", "--store", str(tmp_path), "--device", "cpu", "--profile", "smoke", "--compile", "on"]
    assert main([*argv, "--backend", "torch_chunk", "--run-id", "cut"]) == 130
    said = capsys.readouterr().out
    assert "compile stage interrupted: 1 of" in said, said
    night = json.loads((tmp_path / "runs" / "cut.night.json").read_text())
    assert (
        night["interrupted"] and night["compile"]["results"] == done and night["compile"]["outcomes"] == {"compiled": 1}
    )


def test_a_night_records_its_autotune_choices_in_the_store_unless_told_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash that follows autotune's choice does not come back in a rerun that tunes afresh: every process of a
    night is told to record its choices (KDA_AUTOTUNE_RECORD), into STORE/autotune/<run> unless the caller set a
    folder, and the night file says where (sanitize and triage replay it with --autotune-replay)."""
    from kda_conformance.cli import nightly

    told: list[dict[str, str]] = []

    def pytest_run_here(command, env, console, deadline=None) -> int:
        told.append(env)
        return 0

    monkeypatch.setattr(nightly, "_run_pytest", pytest_run_here)
    monkeypatch.delenv("KDA_AUTOTUNE_RECORD", raising=False)
    argv = ["nightly", "--store", str(tmp_path), "--device", "cpu", "--profile", "smoke", "--backend", "torch_chunk"]
    main([*argv, "--run-id", "rec"])
    assert told[-1]["KDA_AUTOTUNE_RECORD"] == str(tmp_path / "autotune" / "rec")
    night = json.loads((tmp_path / "runs" / "rec.night.json").read_text())
    assert night["autotune_record"] == str(tmp_path / "autotune" / "rec")
    monkeypatch.setenv("KDA_AUTOTUNE_RECORD", str(tmp_path / "mine"))
    main([*argv, "--run-id", "rec2"])
    assert told[-1]["KDA_AUTOTUNE_RECORD"] == str(tmp_path / "mine")


def test_hypothesis_replaying_a_failure_that_does_not_repeat_gets_the_same_failure(tmp_path: Path) -> None:
    """Hypothesis reruns a failing example once more at the end; a kernel whose wrong answer does not repeat
    (SGLang's garbage after a zero-length member on the H200) made that rerun pass, and the test ended in
    hypothesis's FlakyFailure instead of the suite's report. The rerun now gets the first verdict."""
    done = pytest_run(
        "conformance/test_properties.py",
        "-k",
        "test_within_budget",
        "--kda-profile",
        "ci",
        "--kda-examples",
        "3",
        "--kda-plugin",
        "kda_behaviours",
        "--kda-backend",
        "test_wrong_once",
        "--kda-out",
        str(tmp_path),
    )
    assert done.returncode == 1, done.stdout[-3000:]
    assert "Flaky" not in done.stdout, done.stdout[-3000:]
    assert "budget: kda-" in done.stdout and "backend test_wrong_once" in done.stdout, done.stdout[-3000:]
    assert "repro: kda-conformance run" in done.stdout


@pytest.mark.slow
def test_a_case_timeout_is_the_checks_time_not_the_suites_truth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--case-timeout timed the suite's truth and baseline too: an instant backend on T = 1024 was charged
    "no result within 1.5 s". The backend's clock starts when the truth is ready; a truth slower than the
    timeout is the suite's hang."""
    from kda_conformance.running import run as executor
    from kda_conformance.running import truth_cache

    ended: list[int] = []
    monkeypatch.setattr(executor, "end_process", ended.append)
    slow_get = truth_cache.TruthCache.get

    def slow(self, case, precision=None):
        time.sleep(3.0)
        return slow_get(self, case, precision)

    config = build_config(device="cpu", backends=["torch_chunk"], out=tmp_path, case_timeout=2.0)
    run = Run(config)
    monkeypatch.setattr(truth_cache.TruthCache, "get", slow)
    findings = run.checked(get_check("budget"), Drawn(Case(seq_lens=(37,))), registry.get("torch_chunk"))
    assert {f.verdict for f in findings} == {"pass"} and len(ended) == 1, "the backend itself was instant"
    rows = run.rows
    hung = [r for r in rows if r["verdict"] == "error"]
    assert [r["backend"] for r in hung] == ["(suite)"] and "the suite's truth of the case" in hung[0]["reason"]
    # A truth within the timeout: nothing is charged to anyone.
    monkeypatch.setattr(truth_cache.TruthCache, "get", slow_get)
    again = run.checked(get_check("budget"), Drawn(Case(seq_lens=(37,), seed=2)), registry.get("torch_chunk"))
    assert {f.verdict for f in again} == {"pass"} and len(ended) == 1
