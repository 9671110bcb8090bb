"""Prefix invariance: changing every token at and after p must not reach the outputs before p.

The backend first runs the inputs twice: if it is not deterministic, it is reported as such and not blamed
for leaking the future. Otherwise the largest change of the outputs before p is measured, with its ratio
to the case's max-abs limit and where it starts relative to the chunk (of the backend's ``chunk_tokens``)
that holds token p. Two tiers:

- a change beyond the limit is a causal leak: a failure;
- a change within the limit is "not batch-invariant", wherever it starts: a warning, failed under
  --kda-batch-invariant (for kernels that promise batch invariance) and --kda-strict. A chunked kernel may
  round a chunk's outputs differently when its later tokens differ, and one whose batched matmuls or
  inter-chunk scan take every chunk of the call together may round earlier chunks differently too (the
  baseline at 16- and 32-token chunks moved token 0 by 0.047 of the limit when tokens from 55 on changed):
  a change the limit allows is rounding, not the future reaching the past.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from hypothesis import assume
from hypothesis import strategies as st

from kda_cases.case import Case
from kda_cases.profiles import Profile
from kda_conformance.checks._check import Check
from kda_conformance.checks._derived import changed_after
from kda_conformance.checks._registry import draw_case, supported
from kda_conformance.checks.determinism import largest_change, nondeterminism
from kda_conformance.checks.split_resume import CHECK as SPLIT
from kda_conformance.judging.judge import Judge
from kda_conformance.running.blame import call_backend
from kda_conformance.running.runnable import Drawn
from kda_conformance.running.truth import CaseTruth
from kda_kernels.protocol import Backend
from kda_reports.findings import Finding, Location

NAME = "prefix"
CAUSAL_LEAK, NOT_BATCH_INVARIANT = "causal leak", "not batch-invariant"


def draw(data: st.DataObject, profile: Profile, backend: Backend) -> Drawn:
    case = draw_case(data, profile, backend)
    length = case.total_tokens if case.packed else case.seq_lens[0]
    assume(length >= 2)
    p = data.draw(st.integers(min_value=1, max_value=length - 1), label="p")
    supported(backend, case)
    return Drawn(case, {"at": p})


def chunk_start(case: Case, p: int, chunk: int) -> int:
    """The first token (row position) of the chunk that holds token p: chunks start over at each sequence."""
    start = 0
    if case.packed:
        start = max(s for _, s, e in case.row_spans if s <= p)
    return start + (p - start) // chunk * chunk


def run(truth: CaseTruth, backend: Backend, params: Mapping[str, object], judge: Judge) -> list[Finding]:
    case, inputs, p = truth.case, truth.inputs, int(str(params["at"]))
    limit = truth.budgets["o"].max_abs.value
    first, again = call_backend(backend, inputs), call_backend(backend, inputs)
    varies = nondeterminism(judge, first, again, truth.budgets)
    before = first.o[:, :p]
    after = call_backend(backend, changed_after(inputs, p)).o[:, :p]
    subject = f"outputs before token {p}"
    if varies is not None:
        # Bits say nothing of a backend that varies by itself: a change past the o limit, and past what it
        # varies by on its own there, still leaks.
        noise = largest_change(first.o[:, :p], again.o[:, :p])
        return [_judged_to_the_limit(judge, varies, subject, before, after, max(limit, 2 * noise))]
    if before.shape != after.shape:
        shapes = f"o of shape {list(after.shape)} (before {p}) for the changed inputs, {list(before.shape)} before"
        return [judge.problem(subject, shapes, tensor="o")]
    differs = (before != after) & ~(before.isnan() & after.isnan())
    if not bool(differs.any()):
        return [dataclasses.replace(judge.passed(subject, "o"), observed="equal")]
    change = largest_change(before, after)
    hits = differs.nonzero()
    row, token, head = (int(x) for x in hits[hits[:, 1].argmin(), :3])
    start = chunk_start(case, p, backend.chunk_tokens)
    where = (
        f"from token {token}, {start - token} tokens before the {backend.chunk_tokens}-token chunk that holds token {p}"
        if token < start
        else f"from token {token}, inside the {backend.chunk_tokens}-token chunk that holds token {p} (from {start})"
    )
    leak = change > limit
    text = f"outputs before token {p} changed by max-abs {change:.3e} ({change / limit:.3g} of the limit) {where}"
    finding = judge.problem(subject, text, Location(row=row, token=token, head=head), "o")
    if leak:
        return [dataclasses.replace(finding, observed=CAUSAL_LEAK)]
    return [dataclasses.replace(finding, verdict="warn", observed=NOT_BATCH_INVARIANT, problems=(), reason=text)]


def _judged_to_the_limit(
    judge: Judge, varies: Finding, subject: str, before: torch.Tensor, after: torch.Tensor, allowed: float
) -> Finding:
    """The prefix check of a backend that varies by itself: outputs before the token moved by later inputs
    past ``allowed`` (the o max-abs limit, or twice what two runs on the same inputs differ by there, the
    larger) are a causal leak; within it, the nondeterminism warning."""
    change = largest_change(before, after) if before.shape == after.shape else float("inf")
    if change <= allowed:
        return dataclasses.replace(
            varies, reason=f"{varies.reason}; outputs before the token moved by later inputs within {allowed:.3e}"
        )
    text = (
        f"outputs before the token moved by max-abs {change:.3e} ({change / allowed:.3g} of what is allowed, "
        f"{allowed:.3e}) when only later inputs changed, beyond what the backend varies by itself ({varies.reason})"
    )
    return dataclasses.replace(judge.problem(subject, text, tensor="o"), observed=CAUSAL_LEAK)


CHECK = Check(
    name=NAME,
    title="prefix invariance",
    suite="properties",
    test_name="test_prefix_outputs_ignore_later_tokens",
    summary="Changing every token at and after p leaves the outputs before p unchanged: a change beyond the "
    "limit is a causal leak; one within the limit, wherever it starts, is reported as not batch-invariant.",
    draw=draw,
    run=run,
    ci_seed=0x412B4B5CD4EE363F85931D8E9BCF41C442DC362756D820DA475117D06B6CE6EB8F27689F5E33B921ECE8569F85CDEA80,
    params=SPLIT.params,
)
