"""Host metadata passed through: a server builds a batch's sequence metadata on the host (FLA's
``cu_seqlens_cpu``; vLLM's ``chunk_indices`` and ``chunk_offsets``) and passes it in, so the kernel does not
sync the device to derive it. The result with it passed in must be bitwise the result with it derived;
where it differs, the passed-in result is judged against the truth (its failure past the limits is this
check's). A derived result off the truth beside a passed-in one that is within its limits, or ten times
closer to the truth, is a warning: the difference is the derived one's, the budget check's finding.
Metadata of the previous batch (stale) must be refused with an error; a backend that takes it silently is
reported with what it did (a warning, failed only under --kda-strict)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from hypothesis import strategies as st

from kda_cases.case import Case
from kda_cases.profiles import Profile
from kda_conformance.checks._check import Check
from kda_conformance.checks._served import draw_served, serving_case
from kda_conformance.judging.judge import Judge
from kda_conformance.judging.metrics import measure
from kda_conformance.running.blame import call_backend
from kda_conformance.running.probe import probe
from kda_conformance.running.runnable import Drawn
from kda_conformance.running.truth import CaseTruth
from kda_kernels.protocol import Backend, BackendOutput
from kda_reports.findings import Finding

NAME = "host_metadata"
CLOSER = 10  # how much closer to the truth the passed-in result must be to leave the difference to the derived one


def stale_bounds(case: Case, chunk: int) -> tuple[int, ...] | None:
    """The previous batch's ``cu_seqlens``: as many sequences, the longest one ``chunk`` tokens shorter (a
    chunk fewer). Stale bounds with fewer chunks than the tokens hold keep a kernel that trusts them inside
    its tensors (more chunks would send it past their end, which kills the process); None where no
    sequence is longer than a chunk."""
    lens = list(case.seq_lens)
    longest = max(range(len(lens)), key=lambda n: lens[n])
    if lens[longest] <= chunk:
        return None
    lens[longest] -= chunk
    return (0, *torch.tensor(lens).cumsum(0).tolist())


def draw(data: st.DataObject, profile: Profile, backend: Backend) -> Drawn:
    return Drawn(draw_served(data, profile, backend, lambda case: case.total_tokens >= 2))


def requires(backend: Backend) -> str | None:
    return None if backend.envelope.host_metadata else f"{backend.name}'s API takes no host metadata"


def _bits_equal(a: BackendOutput, b: BackendOutput) -> bool:
    """The same bits, a final state missing from both counting as equal (a backend that returns none)."""
    return all(
        (x is None and y is None)
        or (
            x is not None
            and y is not None
            and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        )
        for x, y in ((a.o, b.o), (a.final_state, b.final_state))
    )


def _cpu(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.cpu()


def run(truth: CaseTruth, backend: Backend, params: Mapping[str, object], judge: Judge) -> list[Finding]:
    case, inputs = truth.case, truth.inputs
    metadata = backend.host_metadata(inputs.device, torch.tensor(case.offsets))
    if not metadata:
        return [judge.outcome("skip", f"this {backend.name} takes none of {', '.join(backend.envelope.host_metadata)}")]
    names = ", ".join(metadata)
    derived = call_backend(backend, inputs)
    passed = call_backend(backend, dataclasses.replace(inputs, host_metadata=metadata))
    findings = []
    subject = f"{names} passed in, against derived"
    if _bits_equal(passed, derived):
        findings.append(dataclasses.replace(judge.passed(subject), observed="equal"))
    else:
        change = measure("o", passed.o, derived.o.double()).errors.max_abs
        text = f"the result with {names} passed in differs from the result with it derived (max-abs {change:.3e})"
        judged = judge.result(truth.reference, passed, truth.budgets, f"the result with {names} passed in")
        derived_off = measure("o", derived.o, truth.reference.o.to(derived.o.device)).errors.max_abs
        passed_off = next(f.errors.max_abs for f in judged if f.tensor == "o" and f.errors)  # in its own row
        limit = truth.budgets["o"].max_abs.value
        # The difference is the derived result's when that one is off the truth and the passed-in one has
        # no failure, or is far closer (SGLang's graph tables beside its derivation on a zero-length member,
        # in fp32: the passed-in result 18x its limit by TF32, the derived one 5.2 off); the passed-in
        # result's own error is judged in its own rows either way.
        passed_ok = not any(f.failed for f in judged)
        derived_wrong = derived_off > limit and (passed_ok or passed_off * CLOSER < derived_off)
        if not derived_wrong:
            findings.append(dataclasses.replace(judge.problem(subject, text, tensor="o"), observed="differs"))
        else:
            own = (
                "within its limits"
                if passed_ok
                else f"outside its limits too (judged below; max-abs {passed_off:.3e}, "
                f"{passed_off / limit:.3g} of its limit)"
            )
            why = (
                f"{text}: the passed-in one is {own} and the derived one is off the truth by max-abs "
                f"{derived_off:.3e} ({derived_off / limit:.3g} of the limit; the budget check's finding)"
            )
            finding = judge.passed(subject, "o")
            findings.append(dataclasses.replace(finding, verdict="warn", observed="differs: derived wrong", reason=why))
        findings += judged
    bounds = stale_bounds(case, backend.chunk_tokens)
    if bounds is None:
        return findings
    stale = backend.host_metadata(inputs.device, torch.tensor(bounds))
    subject = f"stale {names} (the previous batch's: a chunk fewer)"
    key = (backend.name, str(inputs.device))
    if key not in _STALE:
        _STALE[key] = _what_stale_does(case, backend, inputs.device, stale, truth, derived)
    verdict, observed, reason, probed = _STALE[key]
    stale_finding = dataclasses.replace(judge.passed(subject), verdict=verdict, observed=observed)
    return [*findings, dataclasses.replace(stale_finding, reason=f"{reason} (probed on {probed})")]


# What a backend does with stale metadata is a property of the backend, not of the case: probed once per
# backend and device, in a process of its own (it may die), then reported on every case.
_STALE: dict[tuple[str, str], tuple[str, str, str, str]] = {}


def _what_stale_does(
    case: Case, backend: Backend, device: torch.device, stale: dict, truth: CaseTruth, derived: BackendOutput
) -> tuple[str, str, str, str]:
    """(verdict, observed, reason, the case probed)."""
    used = probe(case, backend, device, stale)
    if used.raised:
        return "pass", "refused", used.raised, case.id
    if used.died:
        return "warn", "crashes", f"taken without a check, and it killed the process: {used.died}", case.id
    assert used.o is not None  # neither raised nor died: the call returned its output
    result = BackendOutput(o=used.o, final_state=used.final_state)
    if _bits_equal(result, BackendOutput(o=derived.o.cpu(), final_state=_cpu(derived.final_state))):
        return "pass", "ignored", "the result is the right one", case.id
    change = measure("o", result.o, truth.reference.o.cpu()).errors
    limit = truth.budgets["o"].max_abs.value
    reason = (
        f"taken without a check: the output is off the truth by max-abs {change.max_abs:.3e} "
        f"({change.max_abs / limit:.3g} of the limit), {change.nonfinite} non-finite values"
    )
    return "warn", "used silently", reason, case.id


CHECK = Check(
    name=NAME,
    title="serving: host metadata",
    suite="serving",
    test_name="test_host_metadata_passed_in_equals_derived",
    summary="Sequence metadata passed in from the host gives bitwise the result of metadata derived; the "
    "previous batch's is refused, or reported with what it did (probed in a process of its own).",
    draw=draw,
    run=run,
    ci_seed=0x686F73745F6D65746164617461,
    prepare=serving_case,
    requires=requires,
)
