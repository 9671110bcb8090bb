"""Hypothesis strategies for cases: small choices drawn by Hypothesis, tensors built from the drawn seed.

Drawing tensors through Hypothesis would be slow and shrink badly; a Case is a
handful of discrete choices, which shrink well (fewer tokens, fewer heads,
simpler regimes) and whose tensors ``materialize`` builds from ``seed``.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import warnings
from typing import Any, TypeVar

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as fixed_seed
from hypothesis import strategies as st
from hypothesis.errors import HypothesisSideeffectWarning

from kda_cases.case import (
    BETA_REGIMES,
    GATE_REGIMES,
    GATES,
    INITIAL_STATES,
    INPUT_LAYOUTS,
    INPUT_SCALES,
    POOL_LAYOUTS,
    Case,
)
from kda_cases.envelope import ANY, Envelope
from kda_cases.guarantee import guaranteed_cases
from kda_cases.kernel_configs import KernelConfig, kernel_config
from kda_cases.profiles import BOUNDARY_LENGTHS, Profile

CHECKPOINT_GRIDS = (16, 32, 64)
LOWER_BOUNDS = (-5.0, -1.0, -0.01)  # -0.01: the weak-gate bound of AITER's correlated-keys test
KEY_RHOS = (0.9, 0.99, 1.0)

T = TypeVar("T")


def lengths(profile: Profile, most: int, least: int = 1) -> st.SearchStrategy[int]:
    """One sequence length in [least, most]: a boundary length half of the time, any length otherwise."""
    near = [n for n in BOUNDARY_LENGTHS if least <= n <= most]
    anywhere = st.integers(min_value=least, max_value=most)
    return st.one_of(st.sampled_from(near), anywhere) if near else anywhere


@st.composite
def seq_lens(
    draw: st.DrawFn, profile: Profile, budget: int | None = None, packed: bool | None = None
) -> tuple[tuple[int, ...], bool]:
    """Sequence lengths and whether they are packed; packed batches may hold zero-length members.

    ``budget`` caps the total tokens below the profile's; ``packed`` fixes packing (a kernel configuration).
    """
    budget = profile.max_total_tokens if budget is None else budget
    first = draw(lengths(profile, min(budget, BOUNDARY_LENGTHS[-1]), max(1, profile.min_length)))
    count = draw(st.integers(min_value=1, max_value=profile.max_seqs))
    if count == 1:
        return (first,), draw(st.booleans()) if packed is None else packed
    if packed is None:
        if draw(st.booleans()) and first * count <= budget:  # a [B, T] batch: equal lengths
            return (first,) * count, False
    elif not packed:
        return (first,) * max(1, min(count, budget // first)), False
    lens = [first]
    for _ in range(count - 1):
        left = budget - sum(lens)
        lens.append(draw(st.one_of(st.just(0), lengths(profile, left, 1))) if left > 0 else 0)
    order = draw(st.permutations(lens))
    return tuple(order), True


SERVER_BATCH_SHARE = 4  # one drawn case in this many is a server-sized batch, where the profile has them
DECODE_MIX_SHARE = 4  # one packed case with initial states in this many leads with 1-token decodes
SHORT = 16  # most of a server batch's requests: a few tokens each (decode-like prefills, short prompts)


@st.composite
def server_batch(
    draw: st.DrawFn, profile: Profile, budget: int, lens: tuple[int, ...], packed: bool
) -> tuple[int, ...]:
    """``lens`` grown into a batch as a server prefills it: 9 to ``profile.server_batch_seqs`` sequences
    within ``budget`` tokens, the drawn ones kept (their lengths' classes stay reached) and the rest mostly
    short, some empty (packed only) and some long; a [B, T] batch has one length for all."""
    most = max(9, profile.server_batch_seqs)
    count = draw(st.one_of(st.just(most), st.integers(min_value=9, max_value=most)))  # the largest, often
    if not packed:
        return (max(1, min(lens[0], budget // count)),) * count
    grown = list(lens)
    while len(grown) < count:
        left = budget - sum(grown)
        kind = draw(st.sampled_from(("short",) * 6 + ("empty", "long")))
        if kind == "empty" or left <= 0:
            grown.append(0)
        elif kind == "short":
            grown.append(draw(st.integers(min_value=1, max_value=min(left, SHORT))))
        else:
            grown.append(draw(lengths(profile, left, 1)))
    return tuple(draw(st.permutations(grown)))


@st.composite
def checkpoints(draw: st.DrawFn, lens: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """State checkpoints on the 16/32/64 grids and off them, including 0 and the sequence end."""
    if not draw(st.booleans()):
        return ()
    marks = set()
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        seq = draw(st.integers(min_value=0, max_value=len(lens) - 1))
        n = lens[seq]
        grid = draw(st.sampled_from(CHECKPOINT_GRIDS))
        on_grid = st.integers(min_value=0, max_value=n // grid).map(functools.partial(operator.mul, grid))
        marks.add((seq, draw(st.one_of(on_grid, st.integers(min_value=0, max_value=n)))))
    return tuple(sorted(marks))


def _inside(values: tuple[T, ...], allowed: tuple[T, ...]) -> tuple[T, ...]:
    """``values`` (a profile's, duplicates weighting them) that ``allowed`` admits, or where it admits none
    of them, ``allowed`` itself: the profile's choices drawn inside an envelope."""
    kept = tuple(v for v in values if v in allowed)
    return kept or tuple(allowed)


def _flag(allowed: tuple[bool, ...]) -> st.SearchStrategy[bool]:
    return st.booleans() if len(set(allowed)) == 2 else st.just(allowed[0])


def envelope_pool(pool: tuple[KernelConfig, ...], envelope: Envelope) -> tuple[KernelConfig, ...]:
    """The run's kernel configurations an envelope takes; where it takes none, each one moved inside it
    (the narrowest backend still draws from a handful of configurations, not one per case)."""

    def case_of(config: KernelConfig) -> Case:
        fields: dict[str, Any] = dict(config)
        has_h0 = fields.pop("has_initial_state")
        return Case(seq_lens=(64,), initial_state="random" if has_h0 else "none", **fields)

    inside = tuple(c for c in pool if envelope.refusal(case_of(c)) is None)
    if inside or not pool:
        return inside
    return tuple(dict.fromkeys(kernel_config(envelope.fit(case_of(c))) for c in pool))


@st.composite
def cases(draw: st.DrawFn, profile: Profile, envelope: Envelope = ANY) -> Case:
    """A case within ``profile``'s limits and inside ``envelope`` (a backend's: every axis it takes is drawn
    there, so a narrow backend gets as many cases as a wide one), every axis of the suite drawn (the kernel
    axes from the run's pool of kernel configurations, where the profile has one). With the default
    envelope the draws are the profile's own."""
    pool = envelope_pool(profile.kernel_pool, envelope) if envelope is not ANY else profile.kernel_pool
    config: dict[str, Any] = dict(draw(st.sampled_from(pool))) if pool else {}
    budget = (
        profile.max_total_tokens if envelope.max_tokens is None else min(profile.max_total_tokens, envelope.max_tokens)
    )
    if config:
        per_token = config["num_v_heads"] * config["head_k_dim"] * config["head_v_dim"]
        budget = min(budget, max(profile.min_length, profile.max_work // per_token))
    lens, packed = draw(seq_lens(profile, budget, config.get("packed")))
    heads = draw(st.integers(min_value=1, max_value=profile.max_heads))
    # Groups of 3 too: value-head counts a tensor-parallel split leaves (3, 6, 12 a rank), not powers of two.
    groups = [g for g in (1, 2, 3, 4) if heads * g <= profile.value_heads_limit] if envelope.gva else []
    group = draw(st.sampled_from(groups or [1]))
    head_dims = envelope.head_dim_choices(profile.head_dims)
    head_k_dim = draw(st.sampled_from(head_dims))
    if envelope.equal_head_dims:
        head_v_dim = head_k_dim
    else:
        v_dims = tuple(d for d in head_dims if envelope.takes_head_dim(d, key=False)) or (head_k_dim,)
        head_v_dim = draw(st.one_of(st.just(head_k_dim), st.sampled_from(v_dims)))
    forms = ("lower_bound", "lower_bound", "log") if profile.safe_gates_only else ("lower_bound", "softplus", "log")
    gate = draw(st.sampled_from(_inside(forms, envelope.gates)))
    bound = GATES[gate].bound
    in_range = [b for b in LOWER_BOUNDS if envelope.lower_bound_ok(gate, True, b)] or [
        (envelope.in_kernel_lower_bound or (-5.0, 0.0))[0]
    ]
    if bound == "required":
        safe_gate = True in envelope.safe_gate
        lower_bound = draw(st.sampled_from(in_range if safe_gate else LOWER_BOUNDS))
    elif bound == "optional":
        with_bound = st.sampled_from(in_range)
        if profile.safe_gates_only or False not in envelope.safe_gate:
            lower_bound = draw(with_bound)
        elif True not in envelope.safe_gate:
            lower_bound = None
        else:
            lower_bound = draw(st.one_of(st.none(), with_bound))
        safe_gate = lower_bound is not None
    else:
        lower_bound, safe_gate = None, False
    key_regime = draw(st.sampled_from(("random", "random", "correlated", "repeated")))
    fields: dict[str, Any] = dict(
        seq_lens=lens,
        packed=packed,
        num_heads=heads,
        num_v_heads=heads * group,
        head_k_dim=head_k_dim,
        head_v_dim=head_v_dim,
        dtype=draw(st.sampled_from(_inside(profile.dtypes, envelope.dtypes))),
        state_dtype=draw(st.sampled_from(_inside(("fp32", "fp32", "bf16"), envelope.state_dtypes))),
        gate=gate,
        lower_bound=lower_bound,
        safe_gate=safe_gate,
        gate_regime=draw(st.sampled_from(GATE_REGIMES)),
        key_regime=key_regime,
        key_rho=draw(st.sampled_from(KEY_RHOS)) if key_regime == "correlated" else 0.0,
        beta_regime=draw(st.sampled_from(BETA_REGIMES)),
        l2norm_in_kernel=draw(_flag(envelope.l2norm_in_kernel)),
        beta_sigmoid_in_kernel=draw(_flag(envelope.beta_sigmoid_in_kernel)),
        initial_state=draw(st.sampled_from(INITIAL_STATES)),
        state_layout=draw(st.sampled_from(envelope.state_layouts)),
        checkpoints=draw(checkpoints(lens)) if envelope.checkpoints else (),
        seed=draw(st.integers(min_value=0, max_value=2**31 - 1)),
        # Drawn last: the draws before it, and so every earlier seed's cases, are as they were.
        input_layout=draw(st.sampled_from(INPUT_LAYOUTS)),
        tags=(f"profile:{profile.name}",),
    )
    # Identical keys (rho 1) make the chunk inverse near-singular, where the budget's cap holds even the
    # baseline once outliers pass through the state (docs/tolerance.md): large magnitudes come with other keys.
    identical_keys = key_regime == "correlated" and fields["key_rho"] == 1.0
    fields["input_scale"] = draw(st.sampled_from(("typical",) if identical_keys else INPUT_SCALES))
    # Last again: a share of the cases become server-sized batches (their checkpoints drawn anew).
    if profile.server_batch_seqs and draw(st.integers(min_value=1, max_value=SERVER_BATCH_SHARE)) == 1:
        fields["seq_lens"] = draw(server_batch(profile, budget, lens, packed))
        fields["checkpoints"] = draw(checkpoints(fields["seq_lens"])) if envelope.checkpoints else ()
    # Last of all: the serving harness's pool, dense or in padded pages (each seed's earlier draws kept).
    fields["pool_layout"] = draw(st.sampled_from(POOL_LAYOUTS))
    # And the dtype g and beta arrive in: the tokens', or float32 beside bf16 or fp16 tokens (a server's gate
    # kernel's output), where the envelope takes it; a kernel configuration's own where the run pools them.
    dtype = config.get("dtype", fields["dtype"])
    gate_dtypes = _inside(("same", "same", "fp32"), envelope.gate_dtypes) if dtype != "fp32" else ("same",)
    fields["gate_dtype"] = draw(st.sampled_from(gate_dtypes))
    if "has_initial_state" in config:  # the pool fixes whether there is one; the kind stays drawn
        wanted = config.pop("has_initial_state")
        if (fields["initial_state"] != "none") != wanted:
            fields["initial_state"] = "random" if wanted else "none"
    # Then exact-zero token rows (a zero-filled buffer's, zero q or k tokens), in about one case in four.
    fields["zero_tokens"] = draw(st.sampled_from(("none", "none", "none", "rows")))
    # And, in a packed batch that resumes states, 1 to 3 one-token decodes ahead of the prefills, as vLLM
    # chunks non-speculative decodes with prefills into one call (its ROCm Kimi K3 path got NaN on those rows).
    packed_with_h0 = fields["packed"] and fields["initial_state"] != "none"
    room = min(3, budget - sum(fields["seq_lens"]), profile.max_seqs - len(fields["seq_lens"]))
    if packed_with_h0 and room >= 1 and draw(st.integers(min_value=1, max_value=DECODE_MIX_SHARE)) == 1:
        decodes = draw(st.integers(min_value=1, max_value=room))
        fields["seq_lens"] = (1,) * decodes + tuple(fields["seq_lens"])
        fields["checkpoints"] = tuple((seq + decodes, t) for seq, t in fields["checkpoints"])
    return Case(**{**fields, **config})


def with_kernel_pool(profile: Profile, seed: int | None) -> Profile:
    """``profile`` with its run's pool of kernel configurations (unchanged when the profile has no pool): the
    configurations of the night's guaranteed cases where the profile has them (cases/guarantee.py), else of
    the first ``profile.kernel_configs`` cases drawn from ``seed``."""
    if not profile.kernel_configs or profile.kernel_pool:
        return profile
    pool: list[tuple[tuple[str, object], ...]] = []
    if profile.guaranteed:
        drawn = guaranteed_cases(seed)
    else:
        with warnings.catch_warnings():
            # Drawn while pytest configures (the run header names the pool): Hypothesis warns of work done in a plugin.
            warnings.simplefilter("ignore", HypothesisSideeffectWarning)
            drawn = draw_cases(profile, 8 * profile.kernel_configs, seed)
    for case in drawn:
        entry = kernel_config(case)
        if entry not in pool and len(pool) < profile.kernel_configs:
            pool.append(entry)
    return dataclasses.replace(profile, kernel_pool=tuple(pool))


def kernel_pool_lines(profile: Profile) -> list[str]:
    """The run's kernel configurations, one line each (empty when every case draws its own)."""
    return [
        f"kernel configuration {i}: " + " ".join(f"{name}={value}" for name, value in entry)
        for i, entry in enumerate(profile.kernel_pool)
    ]


def draw_cases(profile: Profile, count: int, seed: int | None = None) -> list[Case]:
    """``count`` distinct cases of ``profile`` outside pytest (for ``kda-conformance run --profile``).

    With ``seed`` the draw is reproducible; a derandomized profile ignores it and always gives the same cases.
    A profile with a kernel pool draws its kernel axes from the pool as it stands (see ``with_kernel_pool``).
    """
    drawn: dict[str, Case] = {}

    @settings(
        max_examples=max(1, count) * 4,
        database=None,
        derandomize=profile.derandomize,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(cases(profile))
    def collect(case: Case) -> None:
        if len(drawn) < count:
            drawn.setdefault(case.id, case)

    if seed is not None and not profile.derandomize:
        collect = fixed_seed(seed)(collect)
    collect()
    return list(drawn.values())
