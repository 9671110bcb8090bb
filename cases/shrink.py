"""Smaller versions of a case, simplest first: what ``kda-conformance minimize`` tries on a failing case.

Hypothesis's shrinking is off (every shrunk case is a new shape, a new Triton compile on a GPU); this
proposes the few reductions a person would try, each one step: no checkpoints, no initial state, one
sequence fewer, shorter sequences (lengths on and around the 16/32/64-token chunk and 2048-token segment
boundaries, and halvings, so a bug that needs a boundary keeps one), fewer heads, smaller head dims,
plainer regimes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

from kda_cases.case import Case
from kda_cases.profiles import BOUNDARY_LENGTHS

HEAD_DIMS = (16, 32, 64, 128, 256)


def shorter_lengths(n: int) -> list[int]:
    """Lengths below ``n`` to try, shortest first: the boundary lengths, powers of two and their
    neighbours, and ``n``'s halvings."""
    marks = set(BOUNDARY_LENGTHS)
    power = 1
    while power < n:
        marks |= {power - 1, power, power + 1}
        power *= 2
    half = n
    while half > 1:
        half //= 2
        marks |= {half, half + 1}
    return sorted(m for m in marks if 1 <= m < n)


def _with_lengths(case: Case, lens: tuple[int, ...]) -> Case:
    checkpoints = tuple((s, min(p, lens[s])) for s, p in case.checkpoints)
    return case.replace(seq_lens=lens, checkpoints=tuple(sorted(set(checkpoints))))


def _without_sequence(case: Case, drop: int) -> Case:
    lens = case.seq_lens[:drop] + case.seq_lens[drop + 1 :]
    checkpoints = tuple((s - (s > drop), p) for s, p in case.checkpoints if s != drop)
    return case.replace(seq_lens=lens, checkpoints=checkpoints)


def smaller_cases(case: Case) -> Iterator[Case]:
    """One-step reductions of ``case``, simplest first; each a valid case (a reduction that would not be
    one, say no token left, is not proposed)."""
    for make in _reductions(case):
        try:
            yield make()
        except ValueError:
            continue


def _reductions(case: Case) -> Iterator[Callable[[], Case]]:
    """Makers of the reductions, in order (a maker raises ValueError where its reduction is no valid case)."""
    if case.checkpoints:
        yield lambda: case.replace(checkpoints=())
    if case.has_initial_state:
        yield lambda: case.replace(initial_state="none")
    if case.num_seqs > 1:
        for drop in range(case.num_seqs):
            yield functools.partial(_without_sequence, case, drop)
    if case.packed:
        for seq, n in enumerate(case.seq_lens):
            for m in shorter_lengths(n):
                yield functools.partial(_with_lengths, case, (*case.seq_lens[:seq], m, *case.seq_lens[seq + 1 :]))
    else:  # a [B, T] batch: every row keeps the same length
        for m in shorter_lengths(case.seq_lens[0]):
            yield functools.partial(_with_lengths, case, (m,) * case.num_seqs)
    group = case.num_v_heads // case.num_heads
    if case.num_heads > 1:
        yield lambda: case.replace(num_heads=1, num_v_heads=group)
    if group > 1:
        yield lambda: case.replace(num_v_heads=case.num_heads)
    for field in ("head_k_dim", "head_v_dim"):
        for dim in (d for d in HEAD_DIMS if d < getattr(case, field)):
            yield functools.partial(case.replace, **{field: dim})
    if case.gate_regime != "typical":
        yield lambda: case.replace(gate_regime="typical")
    if case.key_regime != "random":
        yield lambda: case.replace(key_regime="random", key_rho=0.0)
    if case.input_layout != "contiguous":
        yield lambda: case.replace(input_layout="contiguous")
    if case.input_scale != "typical":
        yield lambda: case.replace(input_scale="typical")
    if case.pool_layout != "dense":
        yield lambda: case.replace(pool_layout="dense")
    if case.gate_dtype != "same":
        yield lambda: case.replace(gate_dtype="same")
    if case.zero_tokens != "none":
        yield lambda: case.replace(zero_tokens="none")


def size(case: Case) -> tuple[int, ...]:
    """What "smaller" means, most important first: tokens, sequences, heads, head dims, initial state,
    checkpoints."""
    return (
        case.total_tokens,
        case.num_seqs,
        case.num_v_heads,
        case.num_heads,
        case.head_k_dim * case.head_v_dim,
        int(case.has_initial_state),
        len(case.checkpoints),
    )
