"""Device-to-host synchronisations: how many one call of the backend makes on CUDA (counted with
``torch.cuda.set_sync_debug_mode``, on a second call, after compile and autotune), an observation recorded
per backend. A server that builds the batch's metadata on the host passes it in so that the kernel makes
none: a backend whose API takes host metadata must make no synchronisation when it is passed (a failure
otherwise). A backend that takes none (vLLM 0.33's copies derive their chunk indices with a read of
``cu_seqlens``) is reported with its count, the difference passing host metadata makes."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping

import torch
from hypothesis import strategies as st

from kda_cases.profiles import Profile
from kda_conformance.checks._check import Check
from kda_conformance.checks._served import draw_served, serving_case
from kda_conformance.judging.judge import Judge
from kda_conformance.running.blame import call_backend
from kda_conformance.running.runnable import Drawn
from kda_conformance.running.truth import CaseTruth
from kda_kernels.guard import add_listener, remove_listener
from kda_kernels.protocol import Backend
from kda_reports.findings import Finding

NAME = "host_syncs"


def count_syncs(call: Callable[[], object], backend: Backend) -> int:
    """The synchronising CUDA operations ``backend``'s own code makes during ``call()``: torch warns once per
    such operation in its sync debug mode, switched on while the backend's call is in flight only (the
    guard tells its listeners when it starts and returns), so the suite's own checks around the call (the
    call contract's comparisons, the stage clock) are not counted, nor those an adapter makes inside it
    under ``guard.suite_work`` (vLLM's out= buffer checked for rows written outside its slice)."""
    before = torch.cuda.get_sync_debug_mode()

    def in_flight(event: str, called: Backend) -> None:
        if called is backend:  # counted from "call" to "returned", less the adapter's own "suite" work
            torch.cuda.set_sync_debug_mode("warn" if event in ("call", "kernel") else before)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        add_listener(in_flight)
        try:
            call()
        finally:
            remove_listener(in_flight)
            torch.cuda.set_sync_debug_mode(before)
    return sum("synchronizing" in str(w.message) for w in seen)


def draw(data: st.DataObject, profile: Profile, backend: Backend) -> Drawn:
    return Drawn(draw_served(data, profile, backend))


def run(truth: CaseTruth, backend: Backend, params: Mapping[str, object], judge: Judge) -> list[Finding]:
    case, inputs = truth.case, truth.inputs
    device = inputs.device
    call_backend(backend, inputs)  # compile and autotune first: their syncs are not the call's
    syncs = count_syncs(lambda: call_backend(backend, inputs), backend)
    findings = [dataclasses.replace(judge.passed("syncs of one call"), observed=f"{syncs} syncs")]
    metadata = backend.host_metadata(device, torch.tensor(case.offsets)) if backend.envelope.host_metadata else {}
    if metadata:
        with_host = dataclasses.replace(inputs, host_metadata=metadata)
        call_backend(backend, with_host)
        passed = count_syncs(lambda: call_backend(backend, with_host), backend)
        subject = f"syncs of one call with {', '.join(metadata)} passed in"
        if passed:
            text = f"{passed} device-to-host synchronisations with the host metadata passed in (none expected)"
            findings.append(dataclasses.replace(judge.problem(subject, text), observed=f"{passed} syncs"))
        else:
            findings.append(dataclasses.replace(judge.passed(subject), observed="0 syncs"))
    return findings


CHECK = Check(
    name=NAME,
    title="serving: host syncs",
    suite="serving",
    test_name="test_device_to_host_syncs_of_one_call",
    summary="The device-to-host synchronisations one call makes on CUDA, recorded; none where host metadata "
    "is passed to a backend whose API takes it.",
    draw=draw,
    run=run,
    ci_seed=0x686F73745F73796E6373,
    prepare=serving_case,
    devices=("cuda",),
)
