"""Running cases through the reference and the backends, one record per case x backend x tensor."""

from __future__ import annotations

import shlex
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from kda_cases.case import DTYPES, Case
from kda_cases.materialize import KDAInputs, materialize
from kda_conformance.compare import compare
from kda_conformance.stages import CLOCK, Lap
from kda_conformance.tolerance import (
    DEFAULT_RULE,
    Budget,
    BudgetRule,
    TensorVerdict,
    case_budgets,
    judge,
    returned_dtype,
)
from kda_kernels.protocol import Backend, BackendOutput, Unsupported
from kda_kernels.torch_chunk import TorchChunk
from kda_reference.recurrent import ReferenceResult
from kda_reference.run import reference_form, run_reference

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


def parse_choices(what: str, text: str, allowed: Sequence[str]) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]``, each one of ``allowed``; the error names ``what`` and the allowed values."""
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in values if x not in allowed]
    if bad or not values:
        raise ValueError(f"{what} {bad or text!r} not allowed; choose from {', '.join(allowed)}")
    return values


def parse_dtypes(text: str) -> list[str]:
    """``"bf16,fp32"`` -> ``["bf16", "fp32"]``, each one of the case dtypes."""
    return parse_choices("dtypes", text, DTYPES)


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


@dataclass(frozen=True)
class CaseTruth:
    """What every backend on one case is measured against: inputs, float64 truth and the budgets."""

    case: Case
    inputs: KDAInputs
    reference: ReferenceResult
    reference_form: str  # "loop" or "chunked"
    budgets: dict[str, Budget]
    reference_seconds: float


def case_truth(case: Case, device: torch.device, rule: BudgetRule = DEFAULT_RULE) -> CaseTruth:
    """Materialize ``case`` on ``device``, run the reference and the same-precision baseline, derive budgets."""
    with CLOCK.stage("materialize", device):
        inputs = materialize(case, device)
    return inputs_truth(inputs, rule)


def inputs_truth(inputs: KDAInputs, rule: BudgetRule = DEFAULT_RULE) -> CaseTruth:
    """The truth and budgets of given inputs (``inputs.case`` describes them; its initial state is the
    tensor's, which may be a stored state a request resumes from)."""
    case, device = inputs.case, inputs.device
    form = reference_form(inputs)
    with CLOCK.stage("reference", device, form) as lap:
        reference = run_reference(inputs, form)
    with CLOCK.stage("baseline", device):
        baseline = TorchChunk().run(inputs)
    with CLOCK.stage("compare", device):
        budgets = case_budgets(case, reference, compare(case, reference, baseline), rule)
    return CaseTruth(case, inputs, reference, form, budgets, lap.seconds)


def repro_command(case: Case, backend: str, device: torch.device) -> str:
    """One shell line that reruns exactly this case on this backend and device."""
    return f"kda-conformance run --device {device.type} --backend {backend} --case {shlex.quote(case.to_json())}"


@dataclass
class Outcome:
    """One backend on one case: a verdict per tensor, or why it did not run."""

    case: Case
    backend: str
    device: torch.device
    status: str  # "ran", "skip" or "error"
    reason: str = ""
    seconds: float = 0.0
    verdicts: tuple[TensorVerdict, ...] = ()
    reference_form: str = ""
    reference_seconds: float = 0.0  # the case's float64 truth, computed once for every backend

    @property
    def repro(self) -> str:
        return repro_command(self.case, self.backend, self.device)

    @property
    def failed(self) -> list[TensorVerdict]:
        return [v for v in self.verdicts if not v.passed]


def run_backend(truth: CaseTruth, backend: Backend) -> Outcome:
    """Run ``backend`` on the case and judge every tensor it returned against the case's budgets."""
    case, inputs = truth.case, truth.inputs
    device = inputs.device
    available = backend.availability(device)
    if not available:
        return Outcome(case, backend.name, device, "skip", available.reason)
    supported = backend.supports(case)
    if not supported:
        return Outcome(case, backend.name, device, "skip", supported.reason)
    lap = Lap()  # where the stage's own synchronize raises (an earlier kernel's fault), the lap stays empty
    try:
        with CLOCK.stage("backend", device) as lap:
            result = backend.run(inputs)
    except Unsupported as exc:
        return Outcome(case, backend.name, device, "skip", str(exc))
    except Exception as exc:  # a kernel failure is a result to record, not a crash of the sweep
        last = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"{last.filename.rsplit('/', 1)[-1]}:{last.lineno}"
        return Outcome(
            case,
            backend.name,
            device,
            "error",
            f"{type(exc).__name__}: {exc} (at {where})",
            lap.seconds,
        )
    return Outcome(
        case,
        backend.name,
        device,
        "ran",
        "",
        lap.seconds,
        judge_result(truth, result),
        truth.reference_form,
        truth.reference_seconds,
    )


def judge_result(truth: CaseTruth, result: BackendOutput) -> tuple[TensorVerdict, ...]:
    """A verdict on every tensor ``result`` holds, against the case's truth and budgets."""
    with CLOCK.stage("compare", truth.inputs.device):
        return tuple(
            judge(truth.case, err, truth.budgets[err.tensor], returned_dtype(result, err.tensor))
            for err in compare(truth.case, truth.reference, result)
        )


def outcome_records(outcome: Outcome) -> list[dict]:
    """Flatten an outcome into report rows (one per tensor; one row for a skip or an error)."""
    case = outcome.case
    base = {
        "case_id": case.id,
        "label": case.label,
        "backend": outcome.backend,
        "device": str(outcome.device),
        **{f"case_{k}": v for k, v in _flat_case(case).items()},
        "case_json": case.to_json(),
        "seconds": outcome.seconds,
        "reason": outcome.reason,
        "repro": outcome.repro,
        "reference_form": outcome.reference_form,
        "reference_seconds": outcome.reference_seconds,
    }
    if outcome.status != "ran":
        return [{**base, "tensor": "", "verdict": outcome.status}]
    rows = []
    for v in outcome.verdicts:
        err, budget = v.error, v.budget
        rows.append(
            {
                **base,
                "tensor": err.tensor,
                "verdict": "pass" if v.passed else "fail",
                "budget": budget.max_abs.value,
                "ratio": v.ratio,
                "budget_rel_rms": budget.rel_rms.value,
                "rel_rms_ratio": v.rel_rms_ratio,
                "max_abs": err.max_abs,
                "rel_rms": err.rel_rms,
                "max_abs_over_ref_rms": err.max_abs_over_ref_rms,
                "nonfinite": err.nonfinite,
                "first_bad": v.first_bad,
                "error_curve": ",".join(f"{x:.3g}" for x in err.curve),
                "budget_baseline": budget.max_abs.baseline,
                "budget_floor": budget.max_abs.floor,
                "budget_cap": budget.max_abs.cap,
                "budget_binding": budget.max_abs.binding,
                "baseline_rel_rms": budget.rel_rms.baseline,
                "budget_rel_rms_binding": budget.rel_rms.binding,
                "reason": "; ".join(v.problems),
            }
        )
    return rows


RECORD_LINE_HEADER = (
    f"{'case':17} {'label':42} {'backend':14} {'tensor':12} {'verdict':7} {'max_abs':>9} {'budget':>9} "
    f"{'ratio':>6} {'rel_rms':>9} {'rms_lim':>9} {'s':>7}"
)


def record_line(r: dict) -> str:
    """One record on one line, under RECORD_LINE_HEADER."""

    def num(key: str, width: int = 9, spec: str = ".2e") -> str:
        value = r.get(key)
        return f"{value:{width}{spec}}" if isinstance(value, float) else f"{'':{width}}"

    return (
        f"{r['case_id']:17} {r['label'][:42]:42} {r['backend']:14} {r['tensor'] or '-':12} "
        f"{r['verdict']:7} {num('max_abs')} {num('budget')} {num('ratio', 6, '.2f')} {num('rel_rms')} "
        f"{num('budget_rel_rms')} {r['seconds']:7.2f}"
    )


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
    """Every case through the reference and the baseline once, then through every backend."""
    outcomes = []
    for case in cases:
        truth = case_truth(case, device)
        for backend in backends:
            outcome = run_backend(truth, backend)
            outcomes.append(outcome)
            if on_outcome is not None:
                on_outcome(outcome)
    return outcomes
