"""Running cases through the reference and the backends, one record per case x backend x tensor."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from kda_cases.case import DTYPES, Case
from kda_cases.materialize import materialize
from kda_conformance.compare import TensorError, compare, first_bad, passes, provisional_budget
from kda_kernels.protocol import Backend, Unsupported
from kda_reference.recurrent import ReferenceResult
from kda_reference.run import run_reference

FIRST_SWEEP_LENGTHS = (37, 64, 65, 130)


def first_sweep_cases(
    lengths: Sequence[int] = FIRST_SWEEP_LENGTHS,
    dtypes: Sequence[str] = ("bf16", "fp32"),
    num_heads: int = 2,
    head_dim: int = 64,
    seed: int = 0,
) -> list[Case]:
    """The fixed cases of the first sweep: each length x dtype x (no h0, random h0), plus one packed batch."""
    base = Case(num_heads=num_heads, num_v_heads=num_heads, head_k_dim=head_dim, head_v_dim=head_dim, seed=seed)
    cases = [
        base.replace(seq_lens=(T,), dtype=dtype, initial_state=h0)
        for T in lengths
        for dtype in dtypes
        for h0 in ("none", "random")
    ]
    packed = (min(lengths), 0, max(lengths), 17)
    cases.append(base.replace(seq_lens=packed, packed=True, dtype=dtypes[0], initial_state="random"))
    return cases


def parse_lengths(text: str) -> list[int]:
    """``"37,2048"`` -> ``[37, 2048]``; every length must be a positive integer."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"lengths must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"lengths must be positive integers, got {text!r}")
    return values


def parse_dtypes(text: str) -> list[str]:
    """``"bf16,fp32"`` -> ``["bf16", "fp32"]``, each one of the case dtypes."""
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in values if x not in DTYPES]
    if bad or not values:
        raise ValueError(f"dtypes {bad or text!r} not allowed; choose from {', '.join(DTYPES)}")
    return values


def resolve_device(name: str) -> torch.device:
    """``auto`` picks the GPU when torch sees one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ValueError(f"device={name!r} is not allowed; choose auto, cpu, cuda or cuda:N")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was asked for but torch sees no GPU")
    return device


@dataclass
class Outcome:
    """One backend on one case: its tensor errors, or why it did not run."""

    case: Case
    backend: str
    status: str  # "ran", "skip" or "error"
    reason: str = ""
    seconds: float = 0.0
    errors: tuple[TensorError, ...] = ()


def run_backend(case: Case, backend: Backend, device: torch.device, truth: ReferenceResult, inputs) -> Outcome:  # type: ignore[no-untyped-def]
    available = backend.availability(device)
    if not available:
        return Outcome(case, backend.name, "skip", available.reason)
    supported = backend.supports(case)
    if not supported:
        return Outcome(case, backend.name, "skip", supported.reason)
    start = time.perf_counter()
    try:
        result = backend.run(inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Unsupported as exc:
        return Outcome(case, backend.name, "skip", str(exc))
    except Exception as exc:  # a kernel failure is a result to record, not a crash of the sweep
        last = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"{last.filename.rsplit('/', 1)[-1]}:{last.lineno}"
        return Outcome(
            case, backend.name, "error", f"{type(exc).__name__}: {exc} (at {where})", time.perf_counter() - start
        )
    seconds = time.perf_counter() - start
    return Outcome(case, backend.name, "ran", "", seconds, tuple(compare(case, truth, result)))


def outcome_records(outcome: Outcome, device: torch.device) -> list[dict]:
    """Flatten an outcome into report rows (one per tensor; one row for a skip or an error)."""
    case = outcome.case
    base = {
        "case_id": case.id,
        "label": case.label,
        "backend": outcome.backend,
        "device": str(device),
        **{f"case_{k}": v for k, v in _flat_case(case).items()},
        "seconds": outcome.seconds,
        "reason": outcome.reason,
    }
    if outcome.status != "ran":
        return [{**base, "tensor": "", "verdict": outcome.status}]
    rows = []
    for err in outcome.errors:
        budget = provisional_budget(case, err.tensor)
        rows.append(
            {
                **base,
                "tensor": err.tensor,
                "verdict": "pass" if passes(err, budget) else "fail",
                "budget": budget,
                "max_abs": err.max_abs,
                "rel_rms": err.rel_rms,
                "max_abs_over_ref_rms": err.max_abs_over_ref_rms,
                "nonfinite": err.nonfinite,
                "first_bad": first_bad(case, err, budget),
                "error_curve": ",".join(f"{x:.3g}" for x in err.curve),
                "reason": err.detail,
            }
        )
    return rows


def _flat_case(case: Case) -> dict:
    data = case.to_dict()
    data["seq_lens"] = ",".join(str(n) for n in case.seq_lens)
    data["checkpoints"] = ";".join(f"{s}:{p}" for s, p in case.checkpoints)
    data["tags"] = ",".join(case.tags)
    data["lower_bound"] = float("nan") if case.lower_bound is None else case.lower_bound
    data["scale"] = float("nan") if case.scale is None else case.scale
    data["total_tokens"] = case.total_tokens
    data["num_seqs"] = case.num_seqs
    return data


def run_cases(
    cases: Iterable[Case],
    backends: Sequence[Backend],
    device: torch.device,
    on_outcome: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    """Every case through the reference once and through every backend."""
    outcomes = []
    for case in cases:
        inputs = materialize(case, device)
        truth = run_reference(inputs)
        for backend in backends:
            outcome = run_backend(case, backend, device, truth, inputs)
            outcomes.append(outcome)
            if on_outcome is not None:
                on_outcome(outcome)
    return outcomes
