"""Offsets past 2^31: the case's sequences, packed behind one long sequence of zero tokens so that they start
past 2^31 elements into the token tensors, give what they give alone, within the case's budgets against the
truth.

32-bit block-pointer offsets corrupt results silently once B x T x H x K passes 2^31 (FLA #1080; vLLM and SGLang
took the fix later): a case of 128K tokens at 16 heads of 128 is 2^28 elements, 8 times short, and a float64
truth of 2^31 elements does not fit. So the truth is the drawn case's own, a small one, and only the filler is
large: its tokens are zeros (valid for every gate form; their own output is not judged), and the case's rows
are judged where they land (a chunk kernel's states, one per chunk, are twice q's elements at K = V = 128
and pass 2^31 at half the filler: vLLM's copy already faults there). A GPU check, once per backend a night:
it skips where the batch would not fit the device's memory (its plan says how much it needs) and on the CPU.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

from hypothesis import strategies as st

from kda_cases.case import Case
from kda_cases.dtypes import TORCH_DTYPES
from kda_cases.profiles import Profile
from kda_conformance.checks._check import Check
from kda_conformance.checks._derived import behind_filler
from kda_conformance.checks._registry import draw_case, supported
from kda_conformance.judging.judge import Judge
from kda_conformance.running.blame import NotApplicable, call_backend
from kda_conformance.running.faults import device_memory, is_sticky
from kda_conformance.running.runnable import Drawn
from kda_conformance.running.truth import CaseTruth
from kda_kernels import guard
from kda_kernels.protocol import Backend, BackendOutput
from kda_reports.findings import Finding

NAME = "offsets_past_2_31"
THRESHOLD = 2**31  # elements: past it a 32-bit signed offset wraps
# What the batch may take of the device's memory: the kernel's own scratch (a chunk kernel keeps a state per
# chunk, T/64 x HV x K x V in float32) comes on top of the tensors.
MEMORY_SHARE = 0.8
# Where the batch fails, the same case behind a filler that keeps every tensor at most 1/CONTROL_SHARE of the
# threshold: passing there ties the failure to the size (a wrapped offset), failing there does not (a long
# sequence or the packing is the cause). On an H100 vLLM's copy failed behind 1,048,176 tokens and passed
# behind 262,144 (the results journal, eleventh session).
CONTROL_SHARE = 8
# The longest filler it builds: a case of narrow heads (one head of 32) would need 64M tokens to pass 2^31, minutes
# of a chunk kernel's time; ``prepare`` widens such a case's heads instead.
MAX_FILLER_TOKENS = 2**23
# Head dims ``prepare`` may raise narrow ones to. The filler is set by q's and v's widths, and what a kernel
# allocates per token and head does not shrink with them (FLA's chunk kernel: 8(K + V) + 512 bytes): at H9/9
# K32 V64 bf16 the batch planned 136.5 GiB with FLA's allocations, past an H200's share, and 92.3 at K = V = 64.
WIDE_HEAD_DIM = 64


def filler_tokens(case: Case) -> int:
    """Tokens of zeros that put the case's first token past ``THRESHOLD`` elements of q, k (H x K per token) and
    v (HV x V per token)."""
    per_token = min(case.num_heads * case.head_k_dim, case.num_v_heads * case.head_v_dim)
    return math.ceil(THRESHOLD / per_token) + 1


def judged_filler(subject: str) -> int | None:
    """The tokens of filler a record of this check ran its case behind, where the record is a judgement past the
    threshold (not the control's); None for any other subject."""
    found = re.fullmatch(r"behind (\d+) tokens of filler \(past \d+ elements\)", subject)
    return int(found[1]) if found else None


def control_filler_tokens(case: Case, chunk_tokens: int = 64) -> int:
    """Tokens of zeros that keep every tensor of the batch, a chunk kernel's states (one per ``chunk_tokens``
    tokens, HV x K x V each) included, under ``THRESHOLD / CONTROL_SHARE`` elements."""
    widest = max(
        case.num_heads * case.head_k_dim,
        case.num_v_heads * max(case.head_k_dim, case.head_v_dim),
        math.ceil(case.num_v_heads * case.head_k_dim * case.head_v_dim / chunk_tokens),
    )
    return max(1, THRESHOLD // CONTROL_SHARE // widest - case.total_tokens)


def planned_bytes(case: Case, filler: int, scratch_per_token: int = 0) -> int:
    """What the batch behind the filler needs: its token tensors twice (the guarded call gets copies of its
    inputs), its output, a chunk kernel's states, and what else the backend's call allocates per token
    (``Backend.scratch_bytes_per_token``)."""
    tokens = filler + case.total_tokens
    width = TORCH_DTYPES[case.dtype].itemsize
    gate = 4 if case.gate_dtype == "fp32" else width
    inputs = (2 * case.num_heads * case.head_k_dim + case.num_v_heads * case.head_v_dim) * width
    inputs += case.num_v_heads * case.head_k_dim * gate + case.num_v_heads * 4
    output = case.num_v_heads * case.head_v_dim * width
    states = math.ceil(tokens / 64) * case.num_v_heads * case.head_k_dim * case.head_v_dim * 4
    return tokens * (2 * inputs + output + scratch_per_token) + states


def prepare(case: Case, backend: Backend) -> Case:
    """Packed (the filler is a sequence of the batch), without checkpoints, with as many query heads as value
    heads, and wide enough that at most ``MAX_FILLER_TOKENS`` tokens of filler pass the threshold: the heads
    multiplied where the drawn ones are too few or too narrow; the head dims raised where that plans less memory
    with the backend's own allocations.

    Equal heads because grouped value heads cost memory and add no offset: the filler is set by the narrower
    of q and v per token, so with 8 value heads to 4 query heads v, g and the output run twice past 2^31 while
    q crosses it (at H4/8 K = V = 128 in bf16 the tensors and states alone planned 88 GiB; at H8/8, 52 GiB,
    92 GiB with FLA's chunk kernel's own allocations: an H200's share holds it, an H100's does not)."""
    if not case.packed or case.checkpoints:
        case = case.replace(packed=True, checkpoints=())
    if case.num_heads != case.num_v_heads:
        case = case.replace(num_heads=case.num_v_heads)
    filler = filler_tokens(case)
    if filler > MAX_FILLER_TOKENS:
        factor = math.ceil(filler / MAX_FILLER_TOKENS)
        case = case.replace(num_heads=case.num_heads * factor, num_v_heads=case.num_v_heads * factor)
    return _cheapest_head_dims(case, backend)


def _cheapest_head_dims(case: Case, backend: Backend) -> Case:
    """The case, or the same with its head dims raised (each to at least ``WIDE_HEAD_DIM``, or both to the wider
    of the two), whichever batch plans the fewest bytes with the backend's own allocations and is inside its
    envelope: narrow heads need a long filler, and a kernel's per-token allocations can outgrow the tensors."""
    wide = max(case.head_k_dim, case.head_v_dim)
    options = [case]
    for k, v in ((max(case.head_k_dim, WIDE_HEAD_DIM), max(case.head_v_dim, WIDE_HEAD_DIM)), (wide, wide)):
        if (k, v) != (case.head_k_dim, case.head_v_dim) and guard.supports(
            backend, option := case.replace(head_k_dim=k, head_v_dim=v)
        ):
            options.append(option)

    def plan(option: Case) -> int:
        return planned_bytes(option, filler_tokens(option), backend.scratch_bytes_per_token(option))

    return min(options, key=plan)  # the first of equals: the case as drawn


def draw(data: st.DataObject, profile: Profile, backend: Backend) -> Drawn:
    case = draw_case(data, profile, backend, prepare)
    supported(backend, case)
    return Drawn(case)


def run(truth: CaseTruth, backend: Backend, params: Mapping[str, object], judge: Judge) -> list[Finding]:
    case, inputs = truth.case, truth.inputs
    filler = filler_tokens(case)
    batch_case = case.replace(seq_lens=(filler, *case.seq_lens), packed=True, checkpoints=())
    support = backend.supports(batch_case)
    if not support:
        raise NotApplicable(f"{backend.name} does not take the batch behind the filler: {support.reason}")
    needed = planned_bytes(case, filler, backend.scratch_bytes_per_token(case))
    memory = device_memory(inputs.device)
    if memory is not None and needed > MEMORY_SHARE * memory:
        raise NotApplicable(
            f"the batch behind {filler} tokens of filler needs about {needed / 2**30:.1f} GiB, more than "
            f"{MEMORY_SHARE:.0%} of the device's {memory / 2**30:.1f} GiB"
        )
    subject = f"behind {filler} tokens of filler (past {THRESHOLD} elements)"
    findings = _behind(truth, backend, judge, filler, subject)
    if not any(f.failed for f in findings):
        return findings
    control = control_filler_tokens(case, backend.chunk_tokens)
    said = f"behind {control} tokens of filler (the control, every tensor under {THRESHOLD // CONTROL_SHARE} elements)"
    try:
        again = _behind(truth, backend, judge, control, f"behind {control} tokens of filler (the control)")
    except Exception as exc:
        if is_sticky(exc):  # the device is lost: the run must hear of it as the backend's error on this case
            raise
        said += f" the call raised {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    else:
        worst = [f.worst for f in again if f.failed]
        if not worst:
            said += " the case passes: the failure comes with the size, as a wrapped 32-bit offset does"
        else:
            measured = [w for w in worst if not math.isnan(w)]
            said += " it fails too" + (f" ({max(measured):.3g} of a limit)" if measured else "")
            said += ": a long sequence or the packing, not the size"
    return [dataclasses.replace(f, problems=(*f.problems, said)) if f.failed else f for f in findings]


def _behind(truth: CaseTruth, backend: Backend, judge: Judge, filler: int, subject: str) -> list[Finding]:
    """The case's rows of a call behind ``filler`` tokens of zeros, judged against its truth."""
    batch = call_backend(backend, behind_filler(truth.inputs, filler))
    o = batch.o[:, filler:]
    final = None if batch.final_state is None else batch.final_state[1:]
    return judge.result(truth.reference, BackendOutput(o=o, final_state=final), truth.budgets, subject)


CHECK = Check(
    name=NAME,
    title="offsets past 2^31 elements",
    suite="properties",
    test_name="test_offsets_past_2_31_elements_change_nothing",
    summary="The case's sequences, packed behind a sequence of zero tokens that puts them past 2^31 elements "
    "of the token tensors, are within the case's budgets against the truth.",
    draw=draw,
    run=run,
    ci_seed=0x3B7E1F9A2C5D8E0B4A6C1F3E7D9B2A5C8E0F4D6B1A3C7E9F2D5B8A0C6E1F4A7D9B,
    prepare=prepare,
    devices=("cuda",),
    max_examples=1,
)
