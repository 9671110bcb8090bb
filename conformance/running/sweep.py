"""The sweep's engine: which calls a sweep makes (every case on every backend, each case moved into each
backend's envelope: :func:`fit_or_fault`, the one place a case is fitted and a raising fit charged to its
backend), their findings through the run's executor (in this process or an isolated worker), and the
estimate of how long they take. The front ends (``cli/sweep.py`` with its progress display, the pytest
tests of the first sweep and the corpus) call these; what a sweep shows is theirs."""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass

from kda_cases.case import Case
from kda_conformance.judging.judge import judge_for
from kda_conformance.running.blame import fault_finding
from kda_conformance.running.config import RunConfig
from kda_conformance.running.isolation import run_isolated
from kda_conformance.running.memory import work
from kda_conformance.running.option_values import DEFAULT_CASE_TIMEOUT
from kda_conformance.running.run import Run
from kda_conformance.running.runnable import Drawn, RunnableCheck
from kda_kernels import guard, registry
from kda_kernels.guard import BackendFault
from kda_kernels.protocol import Backend
from kda_reports.findings import Finding

# Past this much planned work (tokens x value heads x K x V, summed over the calls) a sweep says how long it
# expects to take before it starts: a run of --lengths 1000000 worked for 3 minutes on a CPU without a word.
ANNOUNCE_WORK = 2**30
# The two probes' work (about 2K and 16K tokens at 2 heads of 64 x 64): below 2K a call's fixed cost hides
# the rate, and the rate per token on a CPU still grows up to about 32K (0.08 ms a token at 4K, 0.2 at 32K).
PROBE_WORK = (2**24, 2**27)


def fit_or_fault(backend: Backend, case: Case) -> tuple[Case, BackendFault | None]:
    """``case`` moved into ``backend``'s envelope, or ``case`` and the backend's fault where its ``fit`` (or
    the ``supports`` it asks) raised: then the call is the backend's error, not the suite's."""
    try:
        return guard.fit(backend, case), None
    except BackendFault as fault:
        return case, fault


@dataclass(frozen=True)
class Call:
    """One case for one backend: the case as given, moved into the backend's envelope where asked to; or
    the backend's error where its ``fit`` raised on it."""

    case: Case
    backend: str
    fault: BackendFault | None = None


def planned_calls(cases: Sequence[Case], backends: Sequence[str], fit: bool = True) -> list[Call]:
    """Every case on every backend, case by case. With ``fit`` (every sweep but one of given ``--case``s,
    which reruns exactly what it names) each case is moved into each backend's envelope, so the narrowest
    backend runs the grid too, and a case that lands on one the backend already has is not run twice."""
    calls, seen = [], set()
    chosen = [registry.get(name) for name in backends]
    for case in cases:
        for backend in chosen:
            fitted, fault = fit_or_fault(backend, case) if fit else (case, None)
            if (fitted.id, backend.name) not in seen:
                seen.add((fitted.id, backend.name))
                calls.append(Call(fitted, backend.name, fault))
    return calls


def call_findings(run: Run, calls: Sequence[Call], check: RunnableCheck) -> Generator[list[Finding], None, None]:
    """``check`` (the sweeps': the budget check) of every call: in this process (each case's truth computed
    once, the run keeping it for the next backend), or each case in a worker process with ``--isolate``."""
    config = run.config

    def fault_of(call: Call, fault: BackendFault) -> list[Finding]:
        return [fault_finding(judge_for(check.name, call.case, call.backend, config.device), fault)]

    if config.isolate:
        timeout = config.case_timeout or DEFAULT_CASE_TIMEOUT
        runnable = [(c.case, c.backend) for c in calls if c.fault is None]
        isolated = run_isolated(check, runnable, config.device, config.plugins, timeout, config.redraws)
        try:
            for call in calls:
                yield fault_of(call, call.fault) if call.fault is not None else next(isolated)
        finally:
            isolated.close()  # the worker ends with the sweep
        return
    backends = {name: registry.get(name) for name in config.backends}
    for call in calls:
        if call.fault is not None:
            yield fault_of(call, call.fault)
        else:
            yield run.checked(check, Drawn(call.case), backends[call.backend])


def probe_case(case: Case, work_units: int) -> Case:
    """A case of ``case``'s shape (heads, head sizes, dtype) of about ``work_units`` of work."""
    tokens = max(64, work_units // (case.num_v_heads * case.head_k_dim * case.head_v_dim))
    return Case(
        seq_lens=(tokens,), num_heads=case.num_heads, num_v_heads=case.num_v_heads,
        head_k_dim=case.head_k_dim, head_v_dim=case.head_v_dim, dtype=case.dtype,
    )  # fmt: skip


def probe_rate(run: Run, case: Case, check: RunnableCheck) -> tuple[float, float]:
    """Seconds per call and per unit of work, from ``check`` (the budget check) on two short cases of
    ``case``'s shape on the baseline (the float64 truth, the baseline and one call): a line through the two,
    so that a call's fixed cost is not scaled by work (one probe alone overestimated a 1M-token sweep 2.5
    times)."""
    from kda_kernels.torch_chunk import TorchChunk

    run = Run(RunConfig(device=run.config.device, backends=()), journal=False)  # the run's records stay its own
    timed = []
    for units in PROBE_WORK:
        probe = probe_case(case, units)
        began = time.monotonic()
        run.checked(check, Drawn(probe), TorchChunk())
        timed.append((work(probe), time.monotonic() - began))
    (w0, t0), (w1, t1) = timed
    if w1 <= w0:  # both at the smallest probe: no line, the rate of the one
        return 0.0, t1 / w1
    per_work = max(t1 - t0, 0.0) / (w1 - w0)
    return max(t0 - per_work * w0, 0.0), per_work
