"""The Case: every axis of one conformance input as plain, hashable, JSON-able data."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, pairwise
from typing import Any, Protocol

DTYPES = ("bf16", "fp16", "fp32")
STATE_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class GateForm:
    """How a case gives its gate: one entry of ``GATES`` per form, so a new form is one entry here (and its
    drawing in cases/materialize.py where its values differ)."""

    name: str
    short: str  # in case labels
    in_kernel: bool  # the kernel activates a raw pre-activation (A_log, dt_bias); otherwise g is precomputed
    bound: str  # the lower bound: "required" (the safe gate's lb * sigmoid), "optional", or "none"
    meaning: str


GATES = {
    form.name: form
    for form in (
        GateForm("log", "g", False, "optional", "a precomputed log gate g <= 0 (clamped at the bound when it has one)"),
        GateForm("softplus", "sp", True, "none", "in the kernel: g = -exp(A_log) * softplus(g + dt_bias)"),
        GateForm("lower_bound", "lb", True, "required", "in the kernel: g = lb * sigmoid(exp(A_log) * (g + dt_bias))"),
    )
}
GATE_FORMS = tuple(GATES)
GATE_REGIMES = ("typical", "weak", "strong", "reset")
KEY_REGIMES = ("random", "correlated", "repeated")
BETA_REGIMES = ("typical", "near_one")
INITIAL_STATES = ("none", "random", "large")
STATE_LAYOUTS = ("k_first", "v_first")
# How the token tensors lie in memory (cases/materialize.py): each its own contiguous tensor; q, k, v as views
# of one fused projection output and g, beta of another, as vLLM's and SGLang's layers hand them; or each
# a [B, H, T, D] tensor seen as [B, T, H, D] (token stride D, head stride T * D). Same values in each.
INPUT_LAYOUTS = ("contiguous", "fused", "head_major")
# How large the activations are (cases/materialize.py): as drawn (|v| about 4 at most); all of v and q (and
# k where the kernel normalizes it) x10 to x100; or a few tokens and channels of them x100 to x1000, the
# outliers of served models' activations.
INPUT_SCALES = ("typical", "large", "outliers")
# How a server's recurrent-state pool is laid out (kernels/serving.py): one slot after another, or pages padded
# past one slot, as vLLM's hybrid allocator builds them (``torch.as_strided`` over a larger buffer, a slot's own
# plane dense, the gaps between slots someone else's memory).
POOL_LAYOUTS = ("dense", "padded")
# The dtype g and beta arrive in: the tokens' (``same``), or float32 beside bf16 or fp16 tokens, as the servers'
# gate kernels hand them (FLA's fused_kda_gate allocates its output in float32; vLLM's Kimi Linear layer passes
# float32 g and beta to chunk_kda).
GATE_DTYPES = ("same", "fp32")
# Token rows that are exactly zero: a zero-filled static buffer's rows, or a zero hidden state's projection (q, k
# and v all zero), and zero q or k tokens inside a sequence (``rows``); where an l2norm has no epsilon, 0/0.
ZERO_TOKENS = ("none", "rows")
# Axes added after cases were pinned and ledgered: at their default they leave a case's id as it was.
ID_NEUTRAL_DEFAULTS = {
    "input_layout": "contiguous",
    "input_scale": "typical",
    "pool_layout": "dense",
    "gate_dtype": "same",
    "zero_tokens": "none",
}

# Bumped when materialize() changes how it draws tensors from a seed: the same id
# must always mean the same inputs, so the version is part of the id.
GENERATOR_VERSION = 1


class _IntList(Protocol):
    def tolist(self) -> list[int]: ...


def sequence_bounds(batch: int, length: int, cu_seqlens: _IntList | Sequence[int] | None) -> list[tuple[int, int, int]]:
    """``(batch row, start, end)`` of every sequence: one per row of a ``[batch, length]`` layout, or the
    ``cu_seqlens`` spans of row 0 (a tensor or a list), checked the way chunk_kda checks them."""
    if cu_seqlens is None:
        return [(b, 0, length) for b in range(batch)]
    bounds = [int(x) for x in (cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens)]
    if batch != 1:
        raise ValueError(f"cu_seqlens needs batch size 1 (packed sequences), got batch size {batch}")
    if len(bounds) < 2 or bounds[0] != 0 or any(nxt < prev for prev, nxt in pairwise(bounds)):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing with at least 2 entries, got {bounds}")
    if bounds[-1] > length:
        raise ValueError(f"cu_seqlens ends at {bounds[-1]} but the inputs hold only {length} tokens")
    return [(0, s, e) for s, e in pairwise(bounds)]


INTEGER_FIELDS = ("num_heads", "num_v_heads", "head_k_dim", "head_v_dim", "seed")
FLOAT_FIELDS = ("lower_bound", "key_rho", "scale")
BOOL_FIELDS = ("packed", "safe_gate", "l2norm_in_kernel", "beta_sigmoid_in_kernel")


def _is_sequence(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def _sequence(name: str, value: object) -> Sequence[object]:
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise ValueError(f"{name} must be a list, got {value!r}")
    return value


# Every integer of a case is stored as a 64-bit one (a run's parquet columns): larger ones are refused here,
# not by the run's writer after every case has run.
INT64_MAX = 2**63 - 1


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be an integer, got {value!r:.80}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise ValueError(f"{name} must be an integer, got {value!r:.80}")
    whole = int(value)
    if not -INT64_MAX <= whole <= INT64_MAX:
        raise ValueError(f"{name} must be within +-(2^63 - 1), got {str(whole)[:40]}...")
    return whole


def _integers(name: str, value: object) -> tuple[int, ...]:
    return tuple(_integer(name, n) for n in _sequence(name, value))


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


# torch's dtypes and their names, as FLA's tests spell them (``dtype=torch.bfloat16``), by their text: a case
# stays free of torch.
_TORCH_NAMES = {
    "torch.bfloat16": "bf16", "bfloat16": "bf16",
    "torch.float16": "fp16", "float16": "fp16", "torch.half": "fp16", "half": "fp16",
    "torch.float32": "fp32", "float32": "fp32", "torch.float": "fp32", "float": "fp32",
}  # fmt: skip


def _dtype_name(value: object) -> object:
    """A torch dtype (or its name) as the case's name for it; anything else as it is (checked after)."""
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        value = str(value)
    return _TORCH_NAMES.get(value, value) if isinstance(value, str) else value


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """ " (did you mean 'x'?)" for the closest of ``choices`` to a misspelled ``word``, "" where none is close."""
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        hint = did_you_mean(value, allowed)
        raise ValueError(f"{name}={value!r} is not allowed{hint}; choose one of {', '.join(allowed)}")


@dataclass(frozen=True)
class Case:
    """One input configuration. Tensors are drawn from ``seed`` by ``materialize``.

    ``seq_lens`` holds one length per sequence. With ``packed`` the sequences are
    concatenated into one row with ``cu_seqlens`` (zero lengths allowed);
    without it they form a ``[B, T]`` batch, so all lengths must be equal.
    ``checkpoints`` are ``(sequence, tokens)`` pairs: the state after the first
    ``tokens`` tokens of that sequence.
    """

    seq_lens: tuple[int, ...] = (64,)
    packed: bool = False
    num_heads: int = 2
    num_v_heads: int = 2
    head_k_dim: int = 64
    head_v_dim: int = 64
    dtype: str = "bf16"
    state_dtype: str = "fp32"
    gate: str = "lower_bound"
    lower_bound: float | None = -5.0
    safe_gate: bool = True
    gate_regime: str = "typical"
    key_regime: str = "random"
    key_rho: float = 0.0
    beta_regime: str = "typical"
    l2norm_in_kernel: bool = True
    beta_sigmoid_in_kernel: bool = True
    initial_state: str = "none"
    state_layout: str = "k_first"
    input_layout: str = "contiguous"
    input_scale: str = "typical"
    pool_layout: str = "dense"
    gate_dtype: str = "same"
    zero_tokens: str = "none"
    checkpoints: tuple[tuple[int, int], ...] = ()
    scale: float | None = None
    seed: int = 0
    tags: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        # One canonical form per case, so equal cases get one id: lists (from JSON) become tuples (cases stay
        # hashable), -5 becomes -5.0; a value of the wrong type is an error that names its field.
        object.__setattr__(self, "seq_lens", _integers("seq_lens", self.seq_lens))
        checkpoints = _sequence("checkpoints", self.checkpoints)
        pairs = tuple(_integers("checkpoints", c) if _is_sequence(c) else (c,) for c in checkpoints)
        if any(len(p) != 2 for p in pairs):
            raise ValueError(f"checkpoints must be (sequence, tokens) pairs, got {self.checkpoints!r}")
        object.__setattr__(self, "checkpoints", pairs)
        tags = _sequence("tags", self.tags)
        if not all(isinstance(t, str) for t in tags):
            raise ValueError(f"tags must be a list of strings, got {self.tags!r:.80}")
        object.__setattr__(self, "tags", tuple(tags))
        for name in INTEGER_FIELDS:
            object.__setattr__(self, name, _integer(name, getattr(self, name)))
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if value is not None or name == "key_rho":
                object.__setattr__(self, name, _finite(name, value))
        for name in BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.scale is not None and not self.scale > 0:
            raise ValueError(f"scale must be a finite number > 0 (or null: 1/sqrt(head_k_dim)), got {self.scale}")
        if not self.seq_lens:
            raise ValueError("seq_lens must name at least one sequence length")
        if any(n < 0 for n in self.seq_lens):
            raise ValueError(f"seq_lens must be >= 0, got {self.seq_lens}")
        if not self.packed:
            if len(set(self.seq_lens)) != 1:
                raise ValueError(f"seq_lens {self.seq_lens} differ in length: set packed=True to pack them")
            if self.seq_lens[0] == 0:
                raise ValueError("a zero-length sequence needs packed=True (cu_seqlens)")
        if self.total_tokens == 0:
            raise ValueError("seq_lens must hold at least one token in all")
        for name in ("num_heads", "num_v_heads", "head_k_dim", "head_v_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_v_heads % self.num_heads:
            raise ValueError(f"num_v_heads={self.num_v_heads} must be a multiple of num_heads={self.num_heads} (GVA)")
        for name in ("dtype", "state_dtype", "gate_dtype"):
            object.__setattr__(self, name, _dtype_name(getattr(self, name)))
        _choice("dtype", self.dtype, DTYPES)
        _choice("state_dtype", self.state_dtype, STATE_DTYPES)
        _choice("gate", self.gate, GATE_FORMS)
        _choice("gate_regime", self.gate_regime, GATE_REGIMES)
        _choice("key_regime", self.key_regime, KEY_REGIMES)
        _choice("beta_regime", self.beta_regime, BETA_REGIMES)
        _choice("initial_state", self.initial_state, INITIAL_STATES)
        _choice("state_layout", self.state_layout, STATE_LAYOUTS)
        _choice("input_layout", self.input_layout, INPUT_LAYOUTS)
        _choice("input_scale", self.input_scale, INPUT_SCALES)
        _choice("pool_layout", self.pool_layout, POOL_LAYOUTS)
        _choice("gate_dtype", self.gate_dtype, GATE_DTYPES)
        _choice("zero_tokens", self.zero_tokens, ZERO_TOKENS)
        if self.gate_dtype == "fp32" and self.dtype == "fp32":
            raise ValueError("gate_dtype='fp32' is for bf16 or fp16 tokens; with fp32 tokens the gate is fp32: 'same'")
        bound = GATES[self.gate].bound
        if bound == "required" and (self.lower_bound is None or not self.lower_bound < 0):
            raise ValueError(f"gate={self.gate!r} needs lower_bound < 0, got {self.lower_bound}")
        if bound == "none" and self.lower_bound is not None:
            raise ValueError("lower_bound selects the lower-bound gate; use gate='lower_bound' or lower_bound=None")
        if self.safe_gate and self.lower_bound is None:
            raise ValueError("safe_gate=True needs a lower_bound (the bound the gates respect)")
        if not 0.0 <= self.key_rho <= 1.0:
            raise ValueError(f"key_rho must be in [0, 1], got {self.key_rho}")
        for s, p in self.checkpoints:
            if not 0 <= s < self.num_seqs:
                raise ValueError(f"checkpoint sequence {s} out of range: the case has {self.num_seqs} sequences")
            if not 0 <= p <= self.seq_lens[s]:
                raise ValueError(f"checkpoint ({s}, {p}) lies outside sequence {s} of {self.seq_lens[s]} tokens")

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def total_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Sequence start offsets plus the end: the ``cu_seqlens`` of the packed layout."""
        return (0, *accumulate(self.seq_lens))

    def cu_seqlens(self, padding: int = 0) -> tuple[int, ...]:
        """The packed layout's ``cu_seqlens``, with ``padding`` zero-length entries after the last sequence
        (the padding rows of a batch a server pads to a fixed size)."""
        return (*self.offsets, *(self.total_tokens,) * padding)

    @property
    def row_spans(self) -> tuple[tuple[int, int, int], ...]:
        """``(batch row, start, end)`` of each sequence in the materialized ``[B, T, ...]`` tensors."""
        if self.packed:
            return tuple(sequence_bounds(1, self.total_tokens, self.offsets))
        return tuple(sequence_bounds(self.num_seqs, self.seq_lens[0], None))

    @property
    def max_len(self) -> int:
        return max(self.seq_lens)

    @property
    def gate_in_kernel(self) -> bool:
        return GATES[self.gate].in_kernel

    @property
    def state_v_first(self) -> bool:
        return self.state_layout == "v_first"

    @property
    def has_initial_state(self) -> bool:
        return self.initial_state != "none"

    @property
    def has_empty_sequence(self) -> bool:
        """A zero-length member in ``cu_seqlens`` (legal: its final state is its initial state)."""
        return 0 in self.seq_lens

    def to_dict(self) -> dict[str, Any]:
        # Every field is a scalar, a string or a tuple of them: no deep copy (dataclasses.asdict's was 4% of a
        # detection run's CPU time, called for every record and id).
        data = {name: getattr(self, name) for name in _FIELD_NAMES}
        data["seq_lens"] = list(self.seq_lens)
        data["checkpoints"] = [list(c) for c in self.checkpoints]
        data["tags"] = list(self.tags)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Case:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known - {"id"})
        if unknown:
            hints = "".join(did_you_mean(name, known) for name in unknown)
            raise ValueError(f"unknown Case fields {unknown}{hints}; known fields: {sorted(known)}")
        if "seq_lens" not in data:
            raise ValueError("case JSON must give seq_lens (fields it leaves out take the defaults of cases/case.py)")
        fields = {key: value for key, value in data.items() if key in known}
        case = cls(**fields)
        if "id" in data and data["id"] != case.id:
            raise ValueError(
                f"case JSON says id {data['id']} but its fields give {case.id}: "
                "it was written by another generator version or edited by hand"
            )
        return case

    @classmethod
    def from_json(cls, text: str) -> Case:
        return cls.from_dict(json.loads(text))

    def replace(self, **changes: Any) -> Case:
        return dataclasses.replace(self, **changes)

    @functools.cached_property  # a case is frozen, and a run asks its id dozens of times (a hash each)
    def id(self) -> str:
        """Stable short id: a hash of every field that shapes the inputs, plus the generator version."""
        data = self.to_dict()
        data.pop("tags")
        for name, default in ID_NEUTRAL_DEFAULTS.items():
            if data[name] == default:
                del data[name]
        data["generator"] = GENERATOR_VERSION
        digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
        return f"kda-{digest[:12]}"

    @property
    def label(self) -> str:
        """A readable summary for tables; the id is the key."""
        lens = (
            "+".join(str(n) for n in self.seq_lens)
            if len(self.seq_lens) <= 4
            else (f"{self.num_seqs}seq/{self.total_tokens}")
        )
        gate = GATES[self.gate].short
        if self.lower_bound is not None:
            gate += f"{self.lower_bound:g}"
        parts = [
            f"T{lens}",
            self.dtype,
            f"H{self.num_heads}/{self.num_v_heads}",
            f"K{self.head_k_dim}V{self.head_v_dim}",
            gate,
        ]
        if self.gate_regime != "typical":
            parts.append(self.gate_regime)
        if self.key_regime != "random":
            parts.append(f"{self.key_regime}{self.key_rho:g}" if self.key_regime == "correlated" else self.key_regime)
        if self.has_initial_state:
            parts.append(f"h0:{self.initial_state}")
        if self.state_v_first:
            parts.append("vfirst")
        if self.state_dtype != "fp32":
            parts.append(f"S:{self.state_dtype}")
        if self.input_layout != "contiguous":
            parts.append(self.input_layout.replace("_", "-"))
        if self.input_scale != "typical":
            parts.append(f"x:{self.input_scale}")
        if self.pool_layout != "dense":
            parts.append(f"pool:{self.pool_layout}")
        if self.gate_dtype != "same":
            parts.append(f"g:{self.gate_dtype}")
        if self.zero_tokens != "none":
            parts.append(f"zeros:{self.zero_tokens}")
        if self.scale is not None:
            parts.append(f"scale{self.scale:g}")
        return " ".join(parts)

    @property
    def test_id(self) -> str:
        """The case in a pytest test id: its label, selectable with ``-k`` (``-k "bf16 and T2049"``), then its
        id (``T2049_bf16_H2/2_K64V64_lb-5-kda-c2646cfb9360``)."""
        return f"{self.label.replace(' ', '_')}-{self.id}"


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(Case))
