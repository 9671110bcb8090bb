"""What a backward pass on a case is measured against: the upstream gradients it is called with, the float64
gradients, and the budgets of each gradient from the working-precision baseline's backward (docs/tolerance.md,
"Gradients")."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from kda_cases import seeded
from kda_cases.case import Case
from kda_cases.dtypes import GRADIENT_TENSORS, PARAMETER_GRADIENTS, stored_dtype
from kda_cases.materialize import KDAInputs
from kda_conformance.judging.metrics import measure
from kda_conformance.judging.tolerance import DEFAULT_RULE, BudgetRule, InvalidTruth, derive_budget
from kda_conformance.running.blame import NotApplicable
from kda_conformance.running.stages import CLOCK
from kda_kernels.protocol import WorkingPrecision
from kda_kernels.torch_chunk import TorchChunk
from kda_reference.gradients import Gradients, kda_gradients
from kda_reports.findings import Budget, Errors

# The chunk sizes the baseline's backward runs at; a gradient's budget scales the largest error among them. A
# gradient is a long sum of terms that cancel (dg, and dA_log and dt_bias its sums over tokens, most of all with
# strong gates and correlated keys): the baseline at one chunk size understates what a correct kernel that
# chunks otherwise costs (in the ci profile's case T65 fp32 H2/6 K60V32 sp strong, correlated keys 0.99, the
# baseline's algebra at chunk 128 was 3.7 times chunk 64's dg limit and 38 times its dA_log limit, the latter
# then measured against one term's RMS).
BASELINE_CHUNKS = (32, 64, 128)
# The sequences of a packed case whose backward alone is judged: the first ones and the last.
MOST_ALONE = 3
# The gradients with a row per token (a sequence's part of them is its rows); dh0 has one per sequence.
TOKEN_GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta")


@dataclass(frozen=True)
class GradientTruth:
    """The upstream gradients of one case, its float64 gradients by tensor name (``dq``, ``dh0``...) and
    their budgets."""

    case: Case
    d_o: torch.Tensor  # [B, T, HV, V], the tokens' dtype
    d_final: torch.Tensor  # the final states' shape, layout and dtype
    reference: dict[str, torch.Tensor]
    budgets: dict[str, Budget]
    seconds: float
    precision: WorkingPrecision | None = None
    # Per gradient, the (max-abs, RMS) magnitude of the terms it sums, where those are larger than itself
    # (:func:`term_scales`): what its budgets and its rel-RMS are taken relative to.
    scales: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    # For each sequence judged alone (``alone_sequences``), the budgets of its part of each gradient: the rule
    # over the larger of the baseline's errors on the whole gradient and on that part. One sequence's rows may
    # be harder than the average: in the nightly case T6seq/7093 bf16 (a 63-token sequence behind three of
    # 2K) the baseline's dg erred 3.05e-3 of the gradient's scale on that sequence, 8.0e-4 over the whole.
    sequence_budgets: dict[int, dict[str, Budget]] = dataclasses.field(default_factory=dict)


def alone_sequences(case: Case) -> list[tuple[int, tuple[int, int, int]]]:
    """The sequences of a packed case whose backward is judged alone, as ``(n, (row, start, end))``: at most
    ``MOST_ALONE`` non-empty ones, the first and the last; none where fewer than two are non-empty."""
    spans = [(n, span) for n, span in enumerate(case.row_spans) if span[1] < span[2]]
    if not case.packed or len(spans) < 2:
        return []
    return spans if len(spans) <= MOST_ALONE else [*spans[: MOST_ALONE - 1], spans[-1]]


def sequence_part(gradients: dict[str, torch.Tensor], n: int, span: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    """Sequence ``n``'s part of each gradient it has one of: its rows ``span`` of the token gradients, its row of
    dh0 (the parameters' gradients sum over every sequence: no part is one sequence's)."""
    row, start, end = span
    part = {name: x[row : row + 1, start:end] for name, x in gradients.items() if name in TOKEN_GRADIENTS}
    if "dh0" in gradients:
        part["dh0"] = gradients["dh0"][n : n + 1]
    return part


def part_scale(reference: dict[str, torch.Tensor], scales: dict[str, tuple[float, float]], name: str) -> float:
    """What a part of gradient ``name`` (a sequence's rows) has its rel-RMS taken against: the larger of its
    terms' RMS (``scales``) and the whole gradient's RMS. The check measures a sequence run alone on it and its
    budget is set on it (one sequence's dh0, decayed through its tokens, may be a hundredth of an empty
    sequence's, which is its final-state gradient itself)."""
    whole = reference[name]
    return max(scales.get(name, (0.0, 0.0))[1], float(whole.pow(2).mean().sqrt()) if whole.numel() else 0.0)


def upstream_gradients(inputs: KDAInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's upstream gradients ``d_o`` and ``d_final`` (cases/seeded.py ``upstream``) on its device."""
    drawn = seeded.upstream(inputs.case)
    return drawn["d_o"].to(inputs.device), drawn["d_final"].to(inputs.device)


def by_tensor(gradients: Gradients) -> dict[str, torch.Tensor]:
    """``{"dq": ..., "dh0": ...}``: each gradient under the name reports give it."""
    return {GRADIENT_TENSORS[name]: grad for name, grad in gradients.items()}


def gradient_truth(
    inputs: KDAInputs, rule: BudgetRule = DEFAULT_RULE, precision: WorkingPrecision | None = None
) -> GradientTruth:
    """The float64 gradients of ``inputs`` and each gradient's budgets by the forward's rule, the baseline being
    the working-precision backward at each of ``BASELINE_CHUNKS`` (at ``precision`` where a backend declares one,
    with the strict budget kept beside it)."""
    case, device = inputs.case, inputs.device
    d_o, d_final = upstream_gradients(inputs)
    args = (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, inputs.options, d_o, d_final)
    with CLOCK.stage("reference", device) as lap:
        reference = by_tensor(kda_gradients(*args))
    beyond_range(case, reference)

    def baselines(tf32_dots: str | None) -> list[dict[str, torch.Tensor]]:
        return [
            by_tensor(TorchChunk(chunk, tf32_dots=tf32_dots).run_backward(inputs, d_o, d_final))
            for chunk in BASELINE_CHUNKS
        ]

    with CLOCK.stage("baseline", device):
        strict = baselines(None)
        # Only a design's dots change the backward baseline: its chunks are every one of BASELINE_CHUNKS already.
        tf32 = None if precision is None else TorchChunk.at_precision(precision).tf32_dots
        declared = None if precision is None else strict if tf32 is None else baselines(tf32)
    with CLOCK.stage("compare", device):
        terms = gate_gradient_terms(inputs, reference)
        scales, coherent = term_scales(terms), coherent_channel_scale(terms)
        alone = alone_sequences(case)
        judged: list[tuple[int, tuple[int, int, int]] | None] = [None, *alone]

        def budgets_by_part(baselines: list[dict[str, torch.Tensor]], roundoff: float) -> list[dict[str, Budget]]:
            whole = _whole_errors(reference, baselines, scales)
            return [
                _budgets(
                    case,
                    reference,
                    _widest(whole, reference, baselines, scales, part),
                    scales,
                    rule,
                    roundoff,
                    None if part is None else sequence_part(reference, *part),
                    coherent,
                )
                for part in judged
            ]

        kept = budgets_by_part(strict, 0.0)
        if declared is not None and precision is not None:
            kept = [
                {
                    name: dataclasses.replace(ours[name], precision=precision.label, strict=strict_ones[name])
                    for name in ours
                }
                for ours, strict_ones in zip(budgets_by_part(declared, precision.unit_roundoff), kept, strict=True)
            ]
    by_sequence = {n: budgets for (n, _), budgets in zip(alone, kept[1:], strict=True)}
    return GradientTruth(case, d_o, d_final, reference, kept[0], lap.seconds, precision, scales, by_sequence)


def beyond_range(case: Case, reference: dict[str, torch.Tensor]) -> None:
    """Refuse a case whose float64 gradient lies past the largest finite value of the dtype the gradient is
    returned in (an fp16 dq or dk, where l2norm meets an all-zero key or query row: d(x/|x|)/dx grows as 1/|x|,
    to 5e6 on an fp16 case of the nightly): no kernel's gradient of that dtype can hold it, so the check does
    not apply, and the draw is replaced, where a budget from the baseline's overflow would make the case an
    error of the suite's on every backend. Before the baselines: they would only overflow."""
    for name, want in reference.items():
        dtype = stored_dtype(case, name)
        largest = float(want.abs().max()) if want.numel() else 0.0
        if largest > torch.finfo(dtype).max:
            raise NotApplicable(
                f"case {case.id}: the float64 gradient {name} reaches {largest:.3g}, past the largest finite "
                f"{str(dtype).removeprefix('torch.')} ({torch.finfo(dtype).max:.6g}) it is returned in"
            )


def term_scales(terms: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """The (max-abs, RMS) magnitude of the terms the gate's gradients sum, for dg, dA_log and ddt_bias, from each
    one's terms (:func:`gate_gradient_terms`).

    A chunk kernel forms the gradient of the cumulative log decay as ``q * dq - k * dk`` plus the delta rule's
    terms and sums it back over the chunk (FLA's and GLA's backward): where a gate has little effect the terms
    cancel and the gradient is far smaller than they are (exactly zero for the gate of a sequence's first token
    from a zero state), and a correct kernel's error is the terms' rounding, not a fraction of the small
    result. So these gradients are measured against their terms, ``max(|q * dq|, |k * dk|)`` times the gate's
    own derivative (with respect to its input, A_log or dt_bias), token by token, where those are the larger.

    A parameter's gradient (dA_log per head, ddt_bias per head and key channel) is the sum of such terms over
    every token (and for dA_log every key channel): each of its elements is measured against the norm of the
    terms it sums, ``sqrt(sum of their squares)``. A kernel whose every dg is off by a fraction of its terms is
    off by about that fraction of this norm in their sum; against one term's size it would be held sqrt(terms)
    times tighter than dg itself (on an H100, FLA's dA_log on 64 one-token sequences, bf16 K32, a sum of 2048
    terms whose truth is zero: 2.5e-6 off, 1e-5 of one term's RMS and 2.2e-7 of their norm)."""
    scales = {}
    for name, product in terms.items():
        if name in PARAMETER_GRADIENTS and product.numel():
            product = _channel_norms(product)  # [HV, K]: the norm of the terms each ddt_bias sums
            if name == "dA_log":  # one per head: the norm over its channels too
                product = product.pow(2).sum(dim=-1).sqrt()
        scales[name] = _max_and_rms(product)
    return scales


def coherent_channel_scale(terms: dict[str, torch.Tensor]) -> tuple[float, float]:
    """The (max-abs, RMS) over heads of the sum over key channels of the norms of the terms dA_log sums in each
    channel, from the gate gradients' terms (:func:`gate_gradient_terms`; 0 where the case has no dA_log).

    dA_log sums, over the key channels of a head, one sum over the tokens per channel. A kernel whose every
    channel's sum is off by the fraction of its terms' norm that one channel's sum is allowed (ddt_bias's
    limit: the same kind of sum) may have those errors agree in sign across the channels: a rounding shared
    by a token's channels (a half-precision row of dv or dh stored once and read by every channel) does that.
    Their sum is then off by that fraction of this sum of norms, up to sqrt(K) times the norm of all the terms
    that the rel-RMS is taken against. The baseline's channels cancel (on the CPU, at T9 to T130 bf16 and fp16
    K16, its dA_log rel-RMS is 4 to 45 times below its ddt_bias's), FLA's add up (1.6 to 3.4 times above)."""
    product = terms.get("dA_log")
    if product is None or not product.numel():
        return 0.0, 0.0
    return _max_and_rms(_channel_norms(product).sum(dim=-1))


def gate_gradient_terms(inputs: KDAInputs, reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per gate gradient the case has (dg, and dA_log and ddt_bias where the gate is computed in the kernel),
    the size of each term it sums, ``[B, T, HV, K]`` (:func:`term_scales`)."""
    terms = gate_terms(inputs, reference)
    return {name: terms * factor.abs() for name, factor in _gate_derivatives(inputs).items() if name in reference}


def _channel_norms(product: torch.Tensor) -> torch.Tensor:
    """``[B, T, HV, K]`` terms to the norm of each (head, channel)'s terms over every token, ``[HV, K]``."""
    return product.pow(2).sum(dim=(0, 1)).sqrt()


def _max_and_rms(x: torch.Tensor) -> tuple[float, float]:
    return (float(x.max()), float(x.pow(2).mean().sqrt())) if x.numel() else (0.0, 0.0)


def gate_terms(inputs: KDAInputs, reference: dict[str, torch.Tensor]) -> torch.Tensor:
    """``max(|q * dq|, |k * dk|)`` per token, value head and key channel (float64): the size of the terms the
    gradient of the log decay sums there (:func:`term_scales`)."""
    q, k = inputs.q.double(), inputs.k.double()
    terms = torch.maximum((q * reference["dq"]).abs(), (k * reference["dk"]).abs())
    return terms.repeat_interleave(inputs.v.shape[2] // q.shape[2], dim=2)  # per value head, as the gate is


def _gate_derivatives(inputs: KDAInputs) -> dict[str, torch.Tensor]:
    """Per token, the derivative of the log decay with respect to the gate's input (dg), and where the gate is
    computed in the kernel to A_log and dt_bias, in float64 (reference/preprocess.py's forms)."""
    case = inputs.case
    x = inputs.g.double()
    if not case.gate_in_kernel:
        return {"dg": torch.ones_like(x)}
    HV, K = x.shape[-2], x.shape[-1]
    if inputs.dt_bias is not None:
        x = x + inputs.dt_bias.double().reshape(HV, K)
    rate = None if inputs.A_log is None else torch.exp(inputs.A_log.double()).reshape(HV, 1)
    if case.lower_bound is None:  # -rate * softplus(x)
        assert rate is not None
        by_input = -rate * torch.sigmoid(x)
        by_A_log = -rate * torch.nn.functional.softplus(x)
    else:  # lb * sigmoid(rate * x)
        z = x if rate is None else rate * x
        slope = case.lower_bound * torch.sigmoid(z) * (1 - torch.sigmoid(z))
        by_input = slope if rate is None else slope * rate
        by_A_log = slope * z
    return {"dg": by_input, "ddt_bias": by_input, "dA_log": by_A_log}


def _whole_errors(
    reference: dict[str, torch.Tensor], baselines: list[dict[str, torch.Tensor]], scales: dict[str, tuple[float, float]]
) -> dict[str, list[Errors]]:
    """Per gradient, each baseline's errors on it (one per chunk size), relative to the larger of its own RMS and
    its terms' (``scales``)."""
    return {
        name: [measure(name, baseline[name], want, scales.get(name, (0.0, 0.0))[1]).errors for baseline in baselines]
        for name, want in reference.items()
    }


def _widest(
    whole: dict[str, list[Errors]],
    reference: dict[str, torch.Tensor],
    baselines: list[dict[str, torch.Tensor]],
    scales: dict[str, tuple[float, float]],
    part: tuple[int, tuple[int, int, int]] | None,
) -> dict[str, Errors]:
    """Per gradient, the largest of the baselines' errors on the whole of it (``whole``). With ``part`` (a sequence
    and its rows): per gradient that sequence has a part of, the largest on the whole and on that part, the part's
    relative to the whole gradient's scale (as the check measures a sequence run alone)."""
    if part is None:
        return {name: _largest(measured) for name, measured in whole.items()}
    n, span = part
    widest = {}
    for name, want in sequence_part(reference, n, span).items():
        scale = part_scale(reference, scales, name)
        on_part = [measure(name, sequence_part(b, n, span)[name], want, scale).errors for b in baselines]
        widest[name] = _largest(whole[name] + on_part)
    return widest


def _largest(measured: list[Errors]) -> Errors:
    return dataclasses.replace(
        measured[0],
        max_abs=max(e.max_abs for e in measured),
        rel_rms=max(e.rel_rms for e in measured),
        nonfinite=max(e.nonfinite for e in measured),
    )


def _budgets(
    case: Case,
    reference: dict[str, torch.Tensor],
    errors: dict[str, Errors],
    scales: dict[str, tuple[float, float]],
    rule: BudgetRule,
    declared_roundoff: float = 0.0,
    part: dict[str, torch.Tensor] | None = None,
    coherent: tuple[float, float] = (0.0, 0.0),
) -> dict[str, Budget]:
    """The budget of each gradient in ``errors`` (the baselines', ``_widest``) relative to the larger of its
    own magnitude and its terms' (``scales``); with ``part`` (a sequence's part of each gradient), the budget of
    that part, measured against the same scale (``part_scale``).

    The stored dtype's share of the rel-RMS floor is the measured tensor's own RMS over that scale: a part
    larger than the whole's average (on an H100, night-1217, a 5-token sequence's dg with RMS 0.102 where the
    whole's was about half that) would otherwise be held below the rounding of its own values.

    dA_log's floors are no lower than what ddt_bias's rel-RMS limit (dg's without a dt_bias) allows its
    channels' sums when they add up (``coherent``, :func:`coherent_channel_scale`)."""
    budgets: dict[str, Budget] = {}
    for name in sorted(errors, key=lambda n: n == "dA_log"):  # dA_log's floor takes ddt_bias's (or dg's) limit
        measured, want = errors[name], reference[name]
        if not bool(want.isfinite().all()):
            raise InvalidTruth(f"case {case.id}: the float64 gradient {name} holds non-finite values")
        if measured.nonfinite or not math.isfinite(measured.max_abs):
            raise InvalidTruth(f"case {case.id}: the baseline's gradient {name} is not finite: no budget from it")
        scale_max, scale_rms = scales.get(name, (0.0, 0.0))
        ref_max = float(want.abs().max()) if want.numel() else 0.0
        judged = want
        if part is not None and name in part:
            scale_rms, judged = part_scale(reference, scales, name), part[name]
        ref_rms = float(judged.pow(2).mean().sqrt()) if judged.numel() else 0.0
        budgets[name] = derive_budget(
            case,
            name,
            measured,
            ref_max,
            rule,
            elements=want.numel(),
            declared_roundoff=declared_roundoff,
            terms_max_abs=scale_max,
            stored_share=ref_rms / max(ref_rms, scale_rms) if ref_rms > 0 else 0.0,
            least=_channels_allowance(budgets.get("ddt_bias", budgets.get("dg")), coherent, max(ref_rms, scale_rms))
            if name == "dA_log"
            else None,
        )
    return {name: budgets[name] for name in errors}


def _channels_allowance(
    per_channel: Budget | None, coherent: tuple[float, float], against: float
) -> tuple[float, float] | None:
    """The (max-abs, rel-RMS) floor of dA_log: the rel-RMS limit of one channel's sum (``per_channel``: ddt_bias's,
    the same sum with the gate's other derivative, or dg's where the case has no dt_bias) times the coherent sum
    of its channels' term norms (:func:`coherent_channel_scale`), the rel-RMS over what it is measured against
    (``against``: the larger of the norm of all its terms and its own RMS, judging/metrics.py ``measure``)."""
    if per_channel is None or against <= 0:
        return None
    allowed = per_channel.rel_rms.value
    return allowed * coherent[0], allowed * coherent[1] / against
