"""The compile stage: every (backend, kernel configuration) of a night compiled and tuned once, up front,
spread over parallel processes, before the cases run.

On a fresh H200 the first call of FLA's chunk path for a new kernel configuration takes 100 to 170 s
(Triton compile and autotune) and later calls well under a second; a night's workers each met these first
calls in the middle of their cases, several workers compiling the same configuration at once. Here each
job runs a short case of its configuration (cases/kernel_configs.warm_up_case) so that the kernels land in
Triton's cache (compiled binaries, and autotuning results with TRITON_CACHE_AUTOTUNING=1), which the night's
workers share and the next night on the host starts from. A job that fails is noted and left to the night's
cases, which record it properly; a sticky device error ends its process, and the remaining jobs go on in a
new one.

Run as ``python -m kda_conformance.running.compile JOBS RESULTS``: the jobs of one process, its results
appended line by line (a ``start`` line before each job, so a process that dies names the job it died in).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kda_cases.case import Case
from kda_cases.kernel_configs import (
    SMALLEST,
    KernelConfig,
    SizeClass,
    config_label,
    kernel_config,
    size_class,
    size_label,
    warm_up_case,
)

# How often a process that died (a sticky error, a crash) is replaced before its remaining jobs are dropped.
RESTARTS = 8


@dataclasses.dataclass(frozen=True)
class CompileJob:
    backend: str
    case: Case  # a short case of the configuration (and of a size class, where its kernels choose by size)

    @property
    def key(self) -> str:
        size = size_label(size_class(self.case))
        return f"{self.backend} {config_label(kernel_config(self.case))}{f' ({size})' if size else ''}"


def compile_jobs(backends: Sequence[str], configs: Sequence[Case]) -> list[CompileJob]:
    """One job per backend and configuration (each configuration given by one of its cases), each case moved
    into the backend's envelope as the night's tests move it: a backend compiles the configurations it will
    run, once each, and none that it skips."""
    return _jobs([(backend, case) for case in configs for backend in backends])


def shard_jobs(nodeids: Sequence[str], planned: Sequence[Case], drawn_from: Sequence[Case]) -> list[CompileJob]:
    """The jobs a shard of the night needs, from the node ids of its tests: a test of one planned case
    (``test_corpus_case[fla_chunk-T37_bf16_...-kda-7735f63ee3cc]``) needs that case's configuration on that
    backend; a test whose cases are drawn (``test_within_budget[fla_chunk]``) needs every configuration the
    drawn cases take theirs from (``drawn_from``)."""
    by_id = {case.id: case for case in planned}
    pairs = []
    for nodeid in nodeids:
        if not nodeid.endswith("]") or "[" not in nodeid:
            continue
        param = nodeid[nodeid.index("[") + 1 : -1]
        backend = param.split("-", 1)[0]
        case_id = "kda-" + param.rsplit("-kda-", 1)[1] if "-kda-" in param else None
        cases = [by_id[case_id]] if case_id in by_id else ([] if case_id else list(drawn_from))
        pairs += [(backend, case) for case in cases]
    return _jobs(pairs)


def _jobs(pairs: Sequence[tuple[str, Case]]) -> list[CompileJob]:
    """A job per distinct (backend, kernel configuration, size class) of ``pairs``, each case moved into its
    backend's envelope first; a case the backend does not take is no job (its tests skip it, naming the
    envelope).
    Configurations outermost, backends inside: the processes that take them round-robin compile different
    configurations at once."""
    from kda_kernels import guard, registry
    from kda_kernels.guard import BackendFault

    wanted: dict[tuple[str, KernelConfig, SizeClass], Case] = {}
    for backend_name, case in pairs:
        try:
            backend = registry.get(backend_name)
            case = guard.fit(backend, case)
            if not guard.supports(backend, case):
                continue
        except (BackendFault, KeyError, registry.PluginError):  # its tests record that; compile it as given
            pass
        wanted.setdefault((backend_name, kernel_config(case), size_class(case)), case)
    order = {key: i for i, key in enumerate(dict.fromkeys(key[1:] for key in wanted))}
    # The larger size classes first: their jobs are the stage's longest (SGLang's large-grid fp32 path took
    # 242 s of a cold H200's 311 s stage, started last), and the longest first keeps the stage's wall near
    # its longest job. Stable otherwise: backends in the order given.
    keys = sorted(wanted, key=lambda key: (key[2] == SMALLEST, order[key[1:]]))
    return [CompileJob(key[0], warm_up_case(wanted[key])) for key in keys]


CUT = "not compiled"  # the outcome of a job the stage's time budget left undone (or cut mid-job)


def run_jobs(
    jobs: Sequence[CompileJob],
    processes: int,
    device: str,
    plugins: Sequence[str],
    folder: Path,
    gpus: Sequence[str] = (),
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    progress: Callable[[list[dict], int, float], None] | None = None,
) -> list[dict]:
    """Run ``jobs`` over ``processes`` processes (round-robin over ``gpus``, as the night's workers are; in
    ``env``, default this process's environment); one result per job: backend, config, outcome (compiled,
    skipped, failed, died, not run, not compiled), seconds, message. ``progress(results so far, jobs,
    seconds)`` is called about once a second while they run. Past ``timeout_s`` the processes are stopped:
    the jobs they had not finished are ``not compiled`` (a cut, not a crash)."""
    folder.mkdir(parents=True, exist_ok=True)
    shares = [list(jobs[i::processes]) for i in range(max(1, processes))]
    running: list[tuple[subprocess.Popen, list[CompileJob], Path, int, int]] = []
    results: dict[str, dict] = {}
    began = time.monotonic()
    deadline = None if timeout_s is None else began + timeout_s

    def start(index: int, share: list[CompileJob], restarts: int) -> None:
        jobs_file = folder / f"compile-{index}-{restarts}.jobs.json"
        results_file = folder / f"compile-{index}-{restarts}.results.jsonl"
        jobs_file.write_text(json.dumps([{"backend": j.backend, "case": j.case.to_dict()} for j in share]))
        process_env = dict(os.environ if env is None else env)
        if gpus:
            process_env["CUDA_VISIBLE_DEVICES"] = process_env["HIP_VISIBLE_DEVICES"] = gpus[index % len(gpus)]
        command = [sys.executable, "-m", "kda_conformance.running.compile", str(jobs_file), str(results_file)]
        command += ["--device", device, *(arg for p in plugins for arg in ("--plugin", p))]
        process = subprocess.Popen(command, env=process_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        running.append((process, share, results_file, restarts, index))

    def settle(entry: tuple, cut: bool) -> None:
        process, share, results_file, restarts, index = entry
        done, in_flight = _read_results(results_file)
        results.update(done)
        rest = [job for job in share if job.key not in results]
        if cut:
            for job in rest:
                results[job.key] = _result(job, CUT, 0.0, f"the compile stage was cut at {timeout_s:g} s")
            return
        if in_flight is not None and in_flight in {job.key for job in rest}:
            message = f"its process ended during the job (exit code {process.returncode})"
            job = next(j for j in rest if j.key == in_flight)
            results[in_flight] = _result(job, "died", 0.0, message)
            rest = [j for j in rest if j.key != in_flight]
        if rest and restarts < RESTARTS:
            start(index, rest, restarts + 1)
        else:
            for job in rest:
                results[job.key] = _result(job, "not run", 0.0, "its process was replaced too often")

    for index, share in enumerate(shares):
        if share:
            start(index, share, 0)
    try:
        while running:
            if deadline is not None and time.monotonic() >= deadline:
                for entry in running:
                    entry[0].kill()
                    entry[0].wait()
                for entry in list(running):
                    running.remove(entry)
                    settle(entry, cut=True)
                break
            finished = [entry for entry in running if entry[0].poll() is not None]
            for entry in finished:
                running.remove(entry)
                settle(entry, cut=False)
            if progress is not None:
                partial = dict(results)
                for entry in running:
                    partial.update(_read_results(entry[2])[0])
                progress(list(partial.values()), len(jobs), time.monotonic() - began)
            if not finished:
                time.sleep(POLL_S)
    except KeyboardInterrupt:  # Ctrl-C or a time limit: the processes go with it; what they finished is said
        for entry in running:
            entry[0].kill()
            entry[0].wait()
            results.update(_read_results(entry[2])[0])
        raise StageInterrupted([results[job.key] for job in jobs if job.key in results]) from None
    return [results[job.key] for job in jobs if job.key in results]


POLL_S = 0.5


class StageInterrupted(KeyboardInterrupt):
    """The compile stage was interrupted; ``results``: the jobs finished before it."""

    def __init__(self, results: list[dict]) -> None:
        super().__init__("the compile stage was interrupted")
        self.results = results


class Progress:
    """The stage's progress as lines for a terminal or a CI log, at most one per ``every`` seconds (and one when
    the last job is done): jobs done of planned, by backend, the slowest so far, an estimate of what is left."""

    def __init__(self, say: Callable[[str], None], every: float = 30.0) -> None:
        self.say, self.every, self.last, self.done = say, every, 0.0, -1

    def __call__(self, results: list[dict], planned: int, seconds: float) -> None:
        done = len(results)
        if done == self.done or (seconds - self.last < self.every and done < planned):
            return
        self.done, self.last = done, seconds
        by_backend: dict[str, int] = {}
        for result in results:
            by_backend[result["backend"]] = by_backend.get(result["backend"], 0) + 1
        slowest = max(results, key=lambda r: r["seconds"], default=None)
        line = f"compile stage: {done}/{planned} jobs in {seconds:.0f} s"
        if by_backend:
            line += " (" + ", ".join(f"{b} {n}" for b, n in sorted(by_backend.items())) + ")"
        if slowest is not None:
            line += f"; slowest {slowest['job']} {slowest['seconds']:.0f} s"
        if 0 < done < planned:
            line += f"; about {seconds / done * (planned - done):.0f} s left"
        self.say(line)


def _result(job: CompileJob, outcome: str, seconds: float, message: str = "") -> dict:
    return {
        "backend": job.backend,
        "config": config_label(kernel_config(job.case)),
        "job": job.key,
        "outcome": outcome,
        "seconds": round(seconds, 3),
        "message": message[:300],
    }


def _read_results(path: Path) -> tuple[dict[str, dict], str | None]:
    """The finished jobs' results in a process's results file, and the job it started last and did not end."""
    done: dict[str, dict] = {}
    in_flight = None
    if not path.exists():
        return done, None
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if "start" in entry:
            in_flight = entry["start"]
        else:
            done[entry.pop("key")] = entry
            in_flight = None
    return done, in_flight


def summary(results: Sequence[dict], wall_seconds: float) -> dict:
    """The stage in numbers: jobs per outcome, seconds summed over jobs and by backend, the wall time."""
    outcomes: dict[str, int] = {}
    by_backend: dict[str, float] = {}
    for result in results:
        outcomes[result["outcome"]] = outcomes.get(result["outcome"], 0) + 1
        by_backend[result["backend"]] = round(by_backend.get(result["backend"], 0.0) + result["seconds"], 3)
    return {
        "jobs": len(results),
        "outcomes": outcomes,
        "seconds": round(sum(r["seconds"] for r in results), 3),
        "seconds_by_backend": by_backend,
        "wall_seconds": round(wall_seconds, 3),
    }


def _work(jobs_file: Path, results_file: Path, device_name: str, plugins: Sequence[str]) -> int:
    """One compile process: each job's short case through its backend under the call contract."""
    import torch

    from kda_cases.devices import resolve_device, synchronize
    from kda_cases.materialize import materialize
    from kda_conformance.running.faults import DEVICE_LOST_EXIT, is_sticky
    from kda_kernels import guard, registry

    for module in plugins:
        registry.load_plugin(module)
    device = resolve_device(device_name)
    torch.set_num_threads(1)
    with results_file.open("a") as out:

        def write(entry: dict) -> None:
            out.write(json.dumps(entry) + "\n")
            out.flush()

        for raw in json.loads(jobs_file.read_text()):
            job = CompileJob(raw["backend"], Case.from_dict(raw["case"]))
            write({"start": job.key})
            began = time.perf_counter()
            try:
                backend = registry.get(job.backend)
                available = guard.availability(backend, device)
                supported = guard.supports(backend, job.case) if available else available
                if not supported:
                    write({"key": job.key, **_result(job, "skipped", 0.0, supported.reason)})
                    continue
                inputs = materialize(job.case, device)
                guard.run_backend_call(backend, inputs)
                synchronize(device)
            except Exception as exc:  # the night's cases record it properly; here it is only noted
                seconds = time.perf_counter() - began
                write({"key": job.key, **_result(job, "failed", seconds, f"{type(exc).__name__}: {exc}")})
                if is_sticky(exc):
                    return DEVICE_LOST_EXIT  # the context is dead: the rest go on in a new process
                continue
            write({"key": job.key, **_result(job, "compiled", time.perf_counter() - began)})
    return 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("jobs", type=Path)
    parser.add_argument("results", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--plugin", action="append", default=[])
    arguments = parser.parse_args()
    sys.exit(_work(arguments.jobs, arguments.results, arguments.device, arguments.plugin))
