"""Axis coverage: which values of each axis a set of cases reached.

Bugs hide in axis values a sweep never draws: grouped value heads with one query head (where a wrong head
mapping changes nothing), fp32 cases inside one chunk (where a carried-state bug never shows), no case
past 64K tokens. Every run tabulates its cases' values here (the run's summary; pytest's Hypothesis
statistics through ``event``), and a test holds the ``ci`` profile to ``CI_REQUIRED``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pandas as pd

from kda_cases.case import (
    DTYPES,
    GATE_FORMS,
    INPUT_LAYOUTS,
    INPUT_SCALES,
    POOL_LAYOUTS,
    STATE_DTYPES,
    STATE_LAYOUTS,
    ZERO_TOKENS,
    Case,
)

CHUNK = 64  # the chunk of FLA's and AITER's default pipelines; FlashKDA's are 16 and 32, inside it
SEGMENT_EDGES = (2047, 2048, 2049)  # around FlashKDA's segment of 2048 tokens (64 chunks of 32)
LONG_TOKENS = 131072


def _band(case: Case) -> str:
    longest = case.max_len
    for top, name in ((16, "1-16"), (64, "17-64"), (2048, "65-2048"), (16384, "2049-16K"), (65536, "16K-64K")):
        if longest <= top:
            return name
    return "64K+"


def _boundary(case: Case) -> str:
    """Where the longest sequence ends against the 64-token chunks: the classes chunk bugs differ on."""
    longest = case.max_len
    if longest <= CHUNK:
        return "one chunk" if longest < CHUNK else "one full chunk"
    if longest % CHUNK == 0:
        return "ends on a chunk boundary"
    if longest % CHUNK == 1:
        return "one past a boundary"
    return "crosses chunk boundaries"


def _heads(case: Case) -> str:
    if case.num_v_heads == case.num_heads:
        return "H = HV = 1" if case.num_heads == 1 else "H = HV >= 2"
    return "GVA, H = 1" if case.num_heads == 1 else "GVA, H >= 2"


def _value_heads(case: Case) -> str:
    """Whether the value-head count is a power of two: a tensor-parallel split leaves 3, 6, 12 or 24 heads a
    rank (48 heads over 8 ranks: 6), where a kernel that tiles heads by a power of two has a remainder."""
    hv = case.num_v_heads
    return "a power of two" if hv & (hv - 1) == 0 else "not a power of two"


def _head_dims(case: Case) -> str:
    """Whether K and V are powers of two (a kernel's tiles are; 60 and 100 leave a masked remainder)."""
    powers = all(d & (d - 1) == 0 for d in (case.head_k_dim, case.head_v_dim))
    return "powers of two" if powers else "not powers of two"


DECODE_MIX = "packed, 1-token members with h0"


def _packing(case: Case) -> str | tuple[str, ...]:
    """How the sequences are laid out; a packed batch that resumes states and mixes 1-token members (decodes)
    with longer ones (prefills), as servers chunk them into one call, counts as that form too."""
    if not case.packed:
        return "one sequence" if case.num_seqs == 1 else "[B, T] batch"
    form = "packed, a zero-length member" if case.has_empty_sequence else "packed"
    if case.num_seqs == 1:
        return "packed, one sequence"
    if case.has_initial_state and 1 in case.seq_lens and case.max_len > 1:
        return form, DECODE_MIX
    return form


def _precision_edge(case: Case) -> str:
    """fp32 and fp16 across chunk boundaries, with and without an initial state: where bugs of the
    carried state show (in bf16 they drown in rounding)."""
    if case.dtype == "bf16" or case.max_len <= CHUNK:
        return "-"
    return f"{case.dtype} across chunks, " + ("with h0" if case.has_initial_state else "no h0")


def _head_count(case: Case) -> str:
    if case.num_v_heads > case.num_heads:
        return "GVA"
    return "1" if case.num_heads == 1 else ("2-7" if case.num_heads < 8 else ">= 8")


def _length_edges(case: Case) -> tuple[str, ...]:
    """The edges its sequences end on: 64m - 1, 64m, 64m + 1 (chunks), and 2047 to 2049 (FlashKDA's segments)."""
    edges = set()
    for n in case.seq_lens:
        if n >= CHUNK - 1 and n % CHUNK in (CHUNK - 1, 0, 1):
            edges.add({CHUNK - 1: "64m - 1", 0: "64m", 1: "64m + 1"}[n % CHUNK])
        if n in SEGMENT_EDGES:
            edges.add(str(n))
    return tuple(sorted(edges)) or ("-",)


def _checkpoint_positions(case: Case) -> tuple[str, ...]:
    if not case.checkpoints:
        return ("-",)
    return tuple(
        sorted({"on a chunk boundary" if t and t % CHUNK == 0 else "off chunk boundaries" for _, t in case.checkpoints})
    )


def _sequences(case: Case) -> str:
    n = case.num_seqs
    for top, name in ((1, "1"), (8, "2-8"), (16, "9-16"), (64, "17-64")):
        if n <= top:
            return name
    return "65+"


def _programs(case: Case) -> str:
    """(sequence, value head) pairs: the programs of a kernel's per-sequence, per-head grid."""
    pairs = case.num_seqs * case.num_v_heads
    return "<= 128" if pairs <= 128 else ("129-1024" if pairs <= 1024 else "1025+")


# An axis gives one value per case, or several (a case with sequences on two edges counts for both).
AXES: dict[str, Callable[[Case], str | tuple[str, ...]]] = {
    "length band": _band,
    "chunk boundary": _boundary,
    "heads": _heads,
    "value heads": _value_heads,
    "head dims": _head_dims,
    "dtype": lambda c: c.dtype,
    "fp32/fp16 across chunks": _precision_edge,
    "gate": lambda c: c.gate,
    "gate regime": lambda c: c.gate_regime,
    "key regime": lambda c: c.key_regime,
    "initial state": lambda c: c.initial_state,
    "state layout": lambda c: c.state_layout,
    "input layout": lambda c: c.input_layout,
    "input scale": lambda c: c.input_scale,
    "pool layout": lambda c: c.pool_layout,
    "gate dtype": lambda c: "fp32 beside bf16/fp16 tokens" if c.gate_dtype == "fp32" else "the tokens'",
    "zero tokens": lambda c: c.zero_tokens,
    "state dtype": lambda c: c.state_dtype,
    "packing": _packing,
    "sequences": _sequences,
    "(sequence, head) pairs": _programs,
    "checkpoints": lambda c: "some" if c.checkpoints else "none",
    "checkpoint position": _checkpoint_positions,
    "head count": _head_count,
    "head dim K": lambda c: str(c.head_k_dim),
    "head dim V": lambda c: str(c.head_v_dim),
    "K = V = 128": lambda c: c.dtype if c.head_k_dim == c.head_v_dim == 128 else "-",
    "scale": lambda c: "default" if c.scale is None else "explicit",
    "[B, T] batch with h0": lambda c: (
        "B >= 2 with h0" if not c.packed and c.num_seqs >= 2 and c.has_initial_state else "-"
    ),
    "length edge": _length_edges,
    "long (128K tokens)": lambda c: c.dtype if c.total_tokens >= LONG_TOKENS else "-",
}

# What the ci profile (its corpus cases and its drawn ones) must reach: a test fails when one goes unreached.
CI_REQUIRED: dict[str, tuple[str, ...]] = {
    "length band": ("1-16", "17-64", "65-2048"),
    "chunk boundary": (
        "one chunk",
        "one full chunk",
        "ends on a chunk boundary",
        "one past a boundary",
        "crosses chunk boundaries",
    ),
    "heads": ("H = HV = 1", "H = HV >= 2", "GVA, H = 1", "GVA, H >= 2"),
    "value heads": ("a power of two", "not a power of two"),
    "head dims": ("powers of two", "not powers of two"),
    "dtype": ("bf16", "fp16", "fp32"),
    "fp32/fp16 across chunks": (
        "fp32 across chunks, no h0",
        "fp32 across chunks, with h0",
        "fp16 across chunks, no h0",
        "fp16 across chunks, with h0",
    ),
    "gate": GATE_FORMS,
    "gate regime": ("typical", "weak", "strong", "reset"),
    "key regime": ("random", "correlated", "repeated"),
    "initial state": ("none", "random", "large"),
    "state layout": ("k_first", "v_first"),
    "input layout": INPUT_LAYOUTS,
    "input scale": INPUT_SCALES,
    "pool layout": POOL_LAYOUTS,
    "gate dtype": ("the tokens'", "fp32 beside bf16/fp16 tokens"),
    "zero tokens": ZERO_TOKENS,
    "state dtype": ("fp32", "bf16"),
    "packing": ("one sequence", "[B, T] batch", "packed", "packed, a zero-length member", DECODE_MIX),
    "sequences": ("1", "2-8", "17-64"),
    "(sequence, head) pairs": ("<= 128", "129-1024"),
    "checkpoints": ("none", "some"),
    "checkpoint position": ("on a chunk boundary",),
    "head count": (">= 8",),
    "K = V = 128": ("bf16",),
    "scale": ("default", "explicit"),
    "[B, T] batch with h0": ("B >= 2 with h0",),
    "length edge": ("64m + 1",),
}

# What every night reaches on every backend that supports it, whatever its seed (cases/guarantee.py draws the
# cases that make it so; the run's long cases bring 128K tokens in each dtype).
NIGHT_REQUIRED: dict[str, tuple[str, ...]] = {
    "gate": GATE_FORMS,
    "dtype": DTYPES,
    "state dtype": STATE_DTYPES,
    "state layout": STATE_LAYOUTS,
    "input layout": INPUT_LAYOUTS,
    "input scale": INPUT_SCALES,
    "pool layout": POOL_LAYOUTS,
    "gate dtype": ("the tokens'", "fp32 beside bf16/fp16 tokens"),
    "zero tokens": ZERO_TOKENS,
    "scale": ("default", "explicit"),
    "head dim K": ("32", "64", "128", "256"),
    "head dim V": ("32", "64", "128", "256"),
    "K = V = 128": ("bf16", "fp16", "fp32"),
    "head count": ("1", "2-7", ">= 8", "GVA"),
    "value heads": ("a power of two", "not a power of two"),
    "head dims": ("powers of two", "not powers of two"),
    "[B, T] batch with h0": ("B >= 2 with h0",),
    "packing": ("packed, a zero-length member", DECODE_MIX),
    "sequences": ("17-64",),
    "(sequence, head) pairs": ("129-1024",),
    "length edge": ("64m - 1", "64m", "64m + 1", "2047", "2048", "2049"),
    "checkpoint position": ("on a chunk boundary", "off chunk boundaries"),
    "long (128K tokens)": ("bf16", "fp16", "fp32"),
}


def axis_values(case: Case) -> dict[str, tuple[str, ...]]:
    """The values of every axis for one case (most axes: one)."""
    return {axis: (found,) if isinstance(found := value(case), str) else found for axis, value in AXES.items()}


def coverage(cases: Iterable[Case]) -> pd.DataFrame:
    """Distinct cases per axis and value (columns axis, value, cases), in AXES order."""
    counts: dict[tuple[str, str], set[str]] = {}
    for case in cases:
        for axis, values in axis_values(case).items():
            for value in values:
                counts.setdefault((axis, value), set()).add(case.id)
    rows = [{"axis": axis, "value": value, "cases": len(ids)} for (axis, value), ids in counts.items()]
    order = {axis: i for i, axis in enumerate(AXES)}
    table = pd.DataFrame(rows, columns=["axis", "value", "cases"])
    return table.sort_values(["axis", "value"], key=lambda s: s.map(order) if s.name == "axis" else s).reset_index(
        drop=True
    )


def unreached(table: pd.DataFrame, required: dict[str, tuple[str, ...]] = CI_REQUIRED) -> list[str]:
    """The required ``axis: value`` pairs that ``table`` (from ``coverage``) does not hold."""
    reached = {(row["axis"], row["value"]) for row in table.to_dict("records")}
    return [f"{axis}: {value}" for axis, values in required.items() for value in values if (axis, value) not in reached]


def coverage_markdown(table: pd.DataFrame) -> str:
    """The coverage table as markdown, one row per axis: each value reached with its number of cases."""
    lines = ["| axis | values reached (cases) |", "|---|---|"]
    for axis, part in table.groupby("axis", sort=False):
        reached = ", ".join(f"{v} ({n})" for v, n in zip(part["value"], part["cases"], strict=True))
        lines.append(f"| {axis} | {reached} |")
    return "\n".join(lines)
