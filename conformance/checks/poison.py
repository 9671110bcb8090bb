"""Poisoned memory changes nothing: a served batch with poison in every byte it must not use (slot 0, fresh
sequences' slots, checkpoint and spare slots, the output tail, ``torch.empty`` scratch) must equal the
clean run bitwise and write nothing it does not own. A difference is traced to the region it came from."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from hypothesis import strategies as st

from kda_cases.profiles import Profile
from kda_conformance.checks._check import Check, Param
from kda_conformance.checks._served import (
    REGIONS,
    differences,
    draw_served,
    integrity,
    run_serving,
    served_result,
    serving_case,
)
from kda_conformance.checks.determinism import nondeterminism
from kda_conformance.judging.judge import Judge
from kda_conformance.running.runnable import Drawn
from kda_conformance.running.truth import CaseTruth
from kda_kernels.protocol import Backend
from kda_kernels.serving import POISON_MODES, plan_pool, poisoned_scratch
from kda_reports.findings import Finding

NAME = "poison"
POISONS = tuple(m for m in POISON_MODES if m != "none")


def draw(data: st.DataObject, profile: Profile, backend: Backend) -> Drawn:
    case = draw_served(data, profile, backend)
    return Drawn(case, {"poison": data.draw(st.sampled_from(POISONS), label="poison")})


def run(truth: CaseTruth, backend: Backend, params: Mapping[str, object], judge: Judge) -> list[Finding]:
    case, inputs, poison = truth.case, truth.inputs, str(params["poison"])
    plan = plan_pool(case)
    clean = run_serving(backend, inputs, plan, "none")
    findings = judge.result(truth.reference, served_result(clean), truth.budgets, "clean run")
    findings += integrity(judge, clean, "clean run")
    again = run_serving(backend, inputs, plan, "none")
    varies = None
    if differences(judge, again, clean, ""):
        # It varies by itself: a bitwise difference under poison would say nothing of what it read, so the
        # poisoned run is judged against the truth and its limits instead.
        varies = nondeterminism(judge, served_result(clean), served_result(again), truth.budgets)
        subject, reason = "the same served batch, run twice", "two clean runs differ in their slots"
        varies = varies or dataclasses.replace(
            judge.passed(subject), verdict="warn", observed="nondeterministic", reason=reason
        )
        varies = dataclasses.replace(varies, reason=varies.reason + "; the poisoned run judged against the truth")
    with poisoned_scratch(inputs.device, poison):
        poisoned = run_serving(backend, inputs, plan, poison)
    if varies is not None:
        repeat = judge.result(truth.reference, served_result(again), truth.budgets, "second clean run")
        judged = judge.result(truth.reference, served_result(poisoned), truth.budgets, f"{poison} poison")
        return [*findings, varies, *repeat, *judged, *integrity(judge, poisoned, f"{poison} poison")]
    findings += integrity(judge, poisoned, f"{poison} poison")
    moved = differences(judge, poisoned, clean, f"with {poison} poison")
    if moved:
        read = [r for r in REGIONS if differences(judge, run_serving(backend, inputs, plan, poison, (r,)), clean, "")]
        with poisoned_scratch(inputs.device, poison):
            scratch = run_serving(backend, inputs, plan, "none")
        read += ["scratch (torch.empty)"] if differences(judge, scratch, clean, "") else []
        moved.append(
            judge.problem("poison source", "poison reached the result from: " + (", ".join(read) or "no single region"))
        )
    return findings + moved


CHECK = Check(
    name=NAME,
    title="serving: poison",
    suite="serving",
    test_name="test_poisoned_memory_changes_nothing",
    summary="Poison in slot 0, fresh sequences' slots, checkpoint and spare slots, the output tail and "
    "scratch changes nothing and is never written.",
    draw=draw,
    run=run,
    ci_seed=0xE643B085948662FD4A90FD385DD6408C0EF81EB1FB96CD78C22DC894153A65DF2214A6A6C2B0847D35926B8B35329B2B,
    prepare=serving_case,
    params=(Param("poison", str, "what fills memory the backend must not use", POISON_MODES),),
)
