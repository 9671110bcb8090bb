"""What a backend takes, as data: the :class:`Envelope` record.

A backend declares one (``Backend.envelope``, kernels/protocol.py); its ``supports`` answer, its ``fit`` and
the cases drawn for it all come from the record, so the narrowest production kernel (FlashKDA: bf16,
K = V = 128, as many value heads as key heads, the lower-bound gate in the kernel) is drawn inside its
envelope instead of filtered out of the whole space (``cases/strategies.py``), and the docs can list what
every backend claims (``envelope_rows``). A field left at its default admits every value of its axis.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from kda_cases.case import DTYPES, GATE_DTYPES, GATE_FORMS, GATES, STATE_DTYPES, STATE_LAYOUTS, Case

BOTH = (False, True)
DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class Envelope:
    """The cases a backend takes. Each field names the values of one axis (or a bound) it admits; a case
    outside any of them is refused with a reason that names the field (:meth:`refusal`)."""

    dtypes: tuple[str, ...] = DTYPES
    state_dtypes: tuple[str, ...] = STATE_DTYPES
    state_layouts: tuple[str, ...] = STATE_LAYOUTS
    # The head sizes it takes, for K and V alike (None: any up to max_head_k_dim).
    head_dims: tuple[int, ...] | None = None
    max_head_k_dim: int | None = None
    equal_head_dims: bool = False  # K must equal V
    gva: bool = True  # more value heads than query/key heads (HV > H)
    gates: tuple[str, ...] = GATE_FORMS
    safe_gate: tuple[bool, ...] = BOTH
    # [lo, hi) of lower_bound when the kernel computes the safe gate itself (FLA and AITER check -5 <= lb < 0).
    in_kernel_lower_bound: tuple[float, float] | None = None
    l2norm_in_kernel: tuple[bool, ...] = BOTH
    beta_sigmoid_in_kernel: tuple[bool, ...] = BOTH
    checkpoints: bool = True  # takes cases with checkpoints (whether it returns their states is its own matter)
    # The sequence metadata its API can take from the host (FLA's cu_seqlens_cpu): the host-metadata check
    # runs for backends that name some.
    host_metadata: tuple[str, ...] = ()
    # Its call can be captured in a CUDA graph and replayed with new inputs and boundaries (no device-to-host
    # sync, nothing kept on the host per call): the graph-replay check holds it to that; others are only told.
    graph_capture: bool = False
    # It has a backward pass (``Backend.run_backward``): the gradient checks hold it to the float64 gradients.
    backward: bool = False
    max_tokens: int | None = None  # the longest case (total tokens) it should get
    devices: tuple[str, ...] = DEVICE_TYPES  # the device types it runs on
    # The dtypes g and beta may arrive in (cases/case.py GATE_DTYPES): FlashKDA takes its tokens' only.
    gate_dtypes: tuple[str, ...] = GATE_DTYPES

    # What each field admits, in a plugin author's words (docs/envelopes.md's field table is made from it; a
    # test holds every field to having one).
    MEANINGS: ClassVar[dict[str, str]] = {
        "dtypes": "the token dtypes (q, k, v): bf16, fp16, fp32",
        "state_dtypes": "the dtypes of the initial state it is handed: fp32, bf16",
        "state_layouts": "the state layouts: k_first ([K, V]) or v_first ([V, K])",
        "head_dims": "the head sizes it takes, for K and V alike (default: any up to max_head_k_dim)",
        "max_head_k_dim": "the largest K (FLA's chunk kernels: 256)",
        "equal_head_dims": "True: K must equal V",
        "gva": "False: as many value heads as query/key heads (no GVA, HV = H)",
        "gates": "the gate forms: log (precomputed), softplus, lower_bound (computed in the kernel)",
        "safe_gate": "the safe_gate values it takes",
        "in_kernel_lower_bound": "[lo, hi) of lower_bound when the kernel computes the safe gate (FLA: -5 <= lb < 0)",
        "l2norm_in_kernel": "whether q and k may be normalised in the kernel, outside it, or both",
        "beta_sigmoid_in_kernel": "whether beta's sigmoid may be taken in the kernel, outside it, or both",
        "checkpoints": "False: takes no case with intermediate-state checkpoints",
        "host_metadata": "the sequence metadata its API takes from the host (FLA's cu_seqlens_cpu)",
        "graph_capture": "True: its call can be captured in a CUDA graph and replayed with new inputs and boundaries",
        "backward": "True: it has a backward pass, whose gradients the gradient check holds to the float64 ones",
        "max_tokens": "the longest case (total tokens) it should get",
        "devices": "the device types it runs on: cpu, cuda",
        "gate_dtypes": "the dtypes g and beta may arrive in: same (the tokens'), fp32",
    }

    def __post_init__(self) -> None:
        for name, allowed in (
            ("dtypes", DTYPES),
            ("state_dtypes", STATE_DTYPES),
            ("state_layouts", STATE_LAYOUTS),
            ("gates", GATE_FORMS),
            ("devices", DEVICE_TYPES),
            ("gate_dtypes", GATE_DTYPES),
        ):
            values = tuple(getattr(self, name))
            object.__setattr__(self, name, values)
            bad = [v for v in values if v not in allowed]
            if bad or not values:
                raise ValueError(f"Envelope.{name} {bad or values!r} not allowed; choose from {', '.join(allowed)}")
        for name in ("safe_gate", "l2norm_in_kernel", "beta_sigmoid_in_kernel"):
            values = tuple(getattr(self, name))
            object.__setattr__(self, name, values)
            if not values or any(not isinstance(v, bool) for v in values):
                raise ValueError(f"Envelope.{name} must hold True, False or both, got {values!r}")
        if self.head_dims is not None:
            object.__setattr__(self, "head_dims", tuple(self.head_dims))
            if not self.head_dims or any(not isinstance(d, int) or d < 1 for d in self.head_dims):
                raise ValueError(f"Envelope.head_dims must be positive integers, got {self.head_dims!r}")
        if self.in_kernel_lower_bound is not None:
            lo, hi = self.in_kernel_lower_bound
            if not lo < hi <= 0:
                raise ValueError(f"Envelope.in_kernel_lower_bound must be [lo, hi) with lo < hi <= 0, got {lo, hi}")
        if any(GATES[g].bound == "none" for g in self.gates) and False not in self.safe_gate:
            raise ValueError("Envelope: a gate without a lower bound (softplus) needs safe_gate False among its values")

    def head_dim_choices(self, wanted: Sequence[int]) -> tuple[int, ...]:
        """The head sizes of ``wanted`` it takes, or, where it takes none of them, its own (the smallest
        first): a profile's sizes drawn inside the envelope."""
        inside = tuple(d for d in wanted if self.takes_head_dim(d))
        if inside:
            return inside
        if self.head_dims is not None:
            return tuple(sorted(self.head_dims))
        top = self.max_head_k_dim or max(wanted)
        return (min(top, min(wanted)),)

    def takes_head_dim(self, d: int, key: bool = True) -> bool:
        if self.head_dims is not None and d not in self.head_dims:
            return False
        return not (key and self.max_head_k_dim is not None and d > self.max_head_k_dim)

    def lower_bound_ok(self, gate: str, safe_gate: bool, lower_bound: float | None) -> bool:
        if self.in_kernel_lower_bound is None or not (GATES[gate].in_kernel and safe_gate):
            return True
        lo, hi = self.in_kernel_lower_bound
        return lower_bound is not None and lo <= lower_bound < hi

    def refusal(self, case: Case) -> str | None:
        """Why the envelope does not take ``case`` (the field and the values it admits), or None."""
        reasons = []

        def outside(field: str, value: object, allowed: object) -> None:
            reasons.append(f"{field} {allowed} (the case has {value})")

        for field, value, allowed in (
            ("dtypes", case.dtype, self.dtypes),
            ("state_dtypes", case.state_dtype, self.state_dtypes),
            ("state_layouts", case.state_layout, self.state_layouts),
            ("gates", case.gate, self.gates),
            ("safe_gate", case.safe_gate, self.safe_gate),
            ("l2norm_in_kernel", case.l2norm_in_kernel, self.l2norm_in_kernel),
            ("beta_sigmoid_in_kernel", case.beta_sigmoid_in_kernel, self.beta_sigmoid_in_kernel),
            ("gate_dtypes", case.gate_dtype, self.gate_dtypes),
        ):
            if value not in allowed:
                outside(field, value, "/".join(map(str, allowed)))
        if self.head_dims is not None and not {case.head_k_dim, case.head_v_dim} <= set(self.head_dims):
            outside("head_dims", f"K={case.head_k_dim}, V={case.head_v_dim}", "/".join(map(str, self.head_dims)))
        if self.max_head_k_dim is not None and case.head_k_dim > self.max_head_k_dim:
            outside("max_head_k_dim", f"K={case.head_k_dim}", f"<= {self.max_head_k_dim}")
        if self.equal_head_dims and case.head_k_dim != case.head_v_dim:
            outside("equal_head_dims", f"K={case.head_k_dim}, V={case.head_v_dim}", "K = V")
        if not self.gva and case.num_v_heads != case.num_heads:
            outside("gva", f"H={case.num_heads}, HV={case.num_v_heads}", "no GVA (HV = H)")
        if not self.lower_bound_ok(case.gate, case.safe_gate, case.lower_bound):
            lo, hi = self.in_kernel_lower_bound or (0, 0)
            outside("in_kernel_lower_bound", case.lower_bound, f"[{lo:g}, {hi:g}) with the safe gate in the kernel")
        if not self.checkpoints and case.checkpoints:
            outside("checkpoints", f"{len(case.checkpoints)} checkpoints", "none (it returns no intermediate states)")
        if self.max_tokens is not None and case.total_tokens > self.max_tokens:
            outside("max_tokens", f"{case.total_tokens} tokens", f"<= {self.max_tokens}")
        return "takes " + "; ".join(reasons) if reasons else None

    def fit(self, case: Case) -> Case:
        """``case`` moved into the envelope: each field outside it takes the nearest value inside (the first
        one it lists), every other axis is kept. A case inside is returned as it is."""
        if self.refusal(case) is None:
            return case
        changes: dict[str, Any] = {}
        for field, value, allowed in (
            ("dtype", case.dtype, self.dtypes),
            ("state_dtype", case.state_dtype, self.state_dtypes),
            ("state_layout", case.state_layout, self.state_layouts),
            ("l2norm_in_kernel", case.l2norm_in_kernel, self.l2norm_in_kernel),
            ("beta_sigmoid_in_kernel", case.beta_sigmoid_in_kernel, self.beta_sigmoid_in_kernel),
            ("gate_dtype", case.gate_dtype, self.gate_dtypes),
        ):
            if value not in allowed:
                changes[field] = allowed[0]
        K, V = case.head_k_dim, case.head_v_dim
        if not self.takes_head_dim(K):
            K = _nearest(K, self.head_dim_choices([K]))
        if not self.takes_head_dim(V, key=False):
            V = _nearest(V, self.head_dims or (V,))
        if self.equal_head_dims:
            V = K
        changes.update(head_k_dim=K, head_v_dim=V)
        if not self.gva:
            changes["num_v_heads"] = case.num_heads
        changes.update(self._gate(case))
        if not self.checkpoints:
            changes["checkpoints"] = ()
        fitted = case.replace(**changes)
        if self.max_tokens is not None and fitted.total_tokens > self.max_tokens:
            fitted = _shortened(fitted, self.max_tokens)
        return fitted

    def _gate(self, case: Case) -> dict[str, Any]:
        """The gate fields, moved inside: the case's form where allowed (else the first allowed), the safe
        gate as the case has it where allowed, its bound kept where the form and the range allow it (else
        the range's lower end, -5 where there is none)."""
        gate = case.gate if case.gate in self.gates else self.gates[0]
        rule = GATES[gate].bound
        safe = case.safe_gate if case.safe_gate in self.safe_gate else self.safe_gate[0]
        if gate != case.gate and rule == "required" and True in self.safe_gate:
            safe = True  # moved onto the lower-bound gate: as the strategies draw it, with the safe gate
        bound = case.lower_bound
        if rule == "none":
            bound, safe = None, False
        elif (rule == "required" or safe) and (bound is None or not bound < 0):
            bound = -5.0
        if not self.lower_bound_ok(gate, safe, bound):
            bound = (self.in_kernel_lower_bound or (-5.0, 0.0))[0]
        return {"gate": gate, "lower_bound": bound, "safe_gate": safe}

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def narrowed(self, **changes: Any) -> Envelope:
        """This envelope with some fields replaced (a variant of a backend that takes less)."""
        return dataclasses.replace(self, **changes)


def _nearest(value: int, allowed: Sequence[int]) -> int:
    return min(allowed, key=lambda d: (abs(d - value), d))


def _shortened(case: Case, most: int) -> Case:
    """``case`` with its sequences cut so that it holds at most ``most`` tokens."""
    if not case.packed:
        length = max(1, most // case.num_seqs)
        return case.replace(seq_lens=(length,) * case.num_seqs, checkpoints=())
    left, lens = most, []
    for n in case.seq_lens:
        lens.append(min(n, left))
        left -= lens[-1]
    return case.replace(seq_lens=tuple(lens), checkpoints=())


ANY = Envelope()


def shown(envelope: Envelope) -> dict[str, str]:
    """The envelope's fields as the docs' table shows them: ``any`` where a field admits every value."""
    cells = {}
    for field in dataclasses.fields(Envelope):
        value, default = getattr(envelope, field.name), getattr(ANY, field.name)
        if value == default:
            cells[field.name] = "any" if field.name not in ("host_metadata", "graph_capture", "backward") else "-"
        elif isinstance(value, tuple) and field.name != "in_kernel_lower_bound":
            cells[field.name] = ", ".join(map(str, value)) or "-"
        elif field.name == "in_kernel_lower_bound":
            cells[field.name] = f"[{value[0]:g}, {value[1]:g})"
        else:
            cells[field.name] = str(value)
    return cells
