"""Every autotune configuration: each configuration of each autotuned Triton kernel a call launches, pinned one
at a time (the other kernels keep autotune's choices), held to the case's budget against the truth, and named
when it fails or raises.

Which configuration autotune picks depends on the machine, the cache and the timings, so the one that ships on
another GPU may never have won here; vLLM's ROCm Kimi path found a ``num_stages=4`` configuration that raced
and wrote values near 1e38. The call is made once with autotune's choices (which also lists the autotuned
kernels it launched), then once per (kernel, configuration) through kernels/autotune_replay.py's ``pinned``.
A configuration that cannot launch on this GPU (Triton's ``OutOfResources``: more shared memory than the GPU
has, as GLM-5.3-Flash's copy of ``chunk_gated_delta_rule_fwd_kernel_h`` asks at K = V = 256 with 4 stages on an
H100) is one Triton's own autotuner times as infinitely slow and never chooses here: a skip that says so, not a
finding. A backend that launches no autotuned kernel (a CUDA extension, the PyTorch baseline) passes, saying so. On a
GPU only: Triton's CPU interpreter launches each kernel's first configuration (kernels/triton_interpret.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

from hypothesis import strategies as st

from kda_cases.profiles import Profile
from kda_conformance.checks._check import Check
from kda_conformance.checks._registry import draw_case, supported
from kda_conformance.judging.judge import Judge
from kda_conformance.running.blame import call_backend
from kda_conformance.running.faults import is_sticky
from kda_conformance.running.runnable import Drawn
from kda_conformance.running.truth import CaseTruth
from kda_kernels import autotune_replay as replay
from kda_kernels.protocol import Backend
from kda_reports.findings import Finding

NAME = "autotune_configs"
# The check's time on one case: every configuration is a compile (seconds to a minute on a GPU host), and a
# chunk pipeline has dozens; the ones left when it runs out are said, never judged.
SECONDS = 300.0
# What Triton's autotuner catches while it benchmarks and times as infinitely slow, so that it never chooses the
# configuration on this GPU (triton/runtime/autotuner.py, ``Autotuner._bench``).
NEVER_CHOSEN = ("OutOfResources", "CompileTimeAssertionFailure", "PTXASError")


def never_chosen_here(exc: BaseException) -> bool:
    """``exc`` (or what it was raised from) is one of Triton's errors of a configuration this GPU cannot run."""
    seen: BaseException | None = exc
    while seen is not None:
        if any(cls.__name__ in NEVER_CHOSEN and cls.__module__.startswith("triton") for cls in type(seen).__mro__):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def describe(kernel: str, config: dict) -> str:
    """``chunk_kda_fwd_kernel_h BK=64 BV=32 warps=4 stages=3``: the kernel's own name and what it was pinned to."""
    knobs = " ".join(f"{k}={v}" for k, v in sorted(config["kwargs"].items()))
    more = [f"{short}={config[name]}" for name, short in (("num_warps", "warps"), ("num_stages", "stages"))]
    more += [f"ctas={config['num_ctas']}"] if config.get("num_ctas") not in (None, 1) else []
    more += [f"maxnreg={config['maxnreg']}"] if config.get("maxnreg") is not None else []
    return " ".join(part for part in (kernel.rsplit(".", 1)[-1], knobs, *more) if part)


def draw(data: st.DataObject, profile: Profile, backend: Backend) -> Drawn:
    case = draw_case(data, profile, backend)
    supported(backend, case)
    return Drawn(case)


def run(truth: CaseTruth, backend: Backend, params: Mapping[str, object], judge: Judge) -> list[Finding]:
    inputs = truth.inputs
    with replay.launches() as kernels:
        try:
            chosen = call_backend(backend, inputs)
        except Exception as exc:
            if is_sticky(exc):  # a kernel that tuned here ran every configuration: replay choices to pin one
                exc.add_note("with autotune's choices, before any configuration was pinned (tuning runs them all)")
            raise
    findings = judge.result(truth.reference, chosen, truth.budgets, "autotune's choices")
    tried, started = 0, time.monotonic()
    pending = [
        (kernel, config) for kernel, configs in sorted(kernels.items()) if len(configs) > 1 for config in configs
    ]
    for kernel, config in pending:
        if time.monotonic() - started > SECONDS:  # each one is a compile: a night has minutes for the check
            said = f"{tried} of {len(pending)} configurations tried in {SECONDS:g} s; the rest not"
            findings.append(dataclasses.replace(judge.passed("autotuned kernels"), observed="cut", reason=said))
            break
        pinned = replay.config_dict(config)
        label = describe(kernel, pinned)
        tried += 1
        try:
            with replay.pinned(kernel, pinned):
                result = call_backend(backend, inputs)
        except Exception as exc:  # the configuration's own: named, and the others still run
            if is_sticky(exc):  # the device is lost: nothing more runs in this process, but its record names why
                exc.add_note(f"with {label} pinned ({tried} of {len(pending)} configurations tried)")
                raise
            if never_chosen_here(exc):
                said = f"does not run on this GPU, so autotune never chooses it here: {str(exc)[:300]}"
                skipped = dataclasses.replace(judge.outcome("skip", said), subject=f"with {label}")
                findings.append(dataclasses.replace(skipped, observed="configuration does not fit this GPU"))
                continue
            failed = judge.problem(f"with {label}", f"raised {type(exc).__name__}: {str(exc)[:300]}")
            findings.append(dataclasses.replace(failed, observed="configuration raised"))
            continue
        findings += judge.result(truth.reference, result, truth.budgets, f"with {label}")
    if not pending:
        findings.append(dataclasses.replace(judge.passed("autotuned kernels"), observed="none with a choice"))
    return findings


CHECK = Check(
    name=NAME,
    title="every autotune configuration",
    suite="properties",
    test_name="test_every_autotune_configuration_within_budget",
    summary="Each configuration of each autotuned kernel the call launches, pinned one at a time, is within the "
    "case's budgets; a failing or raising configuration is named (kernel, block sizes, warps, stages).",
    draw=draw,
    run=run,
    ci_seed=0x5D1C0A7E4F2B9C3A1E6D8F0B7C2A4E9D3F1B6A8C0E5D7F2A9B4C1E3D6F8A0B2C4E,
    devices=("cuda",),
    max_examples=1,
)
