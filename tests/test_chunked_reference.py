"""The chunked float64 form against the token-loop definition, and the working-precision baseline's error level."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from kda_cases.case import DTYPES, Case
from kda_cases.materialize import materialize
from kda_cases.profiles import Profile
from kda_cases.strategies import cases
from kda_kernels.torch_chunk import TorchChunk
from kda_reference import chunked as chunked_module
from kda_reference.chunked import DEFAULT_CHUNK, FACTORED_SPAN, kda_chunked
from kda_reference.forms import FORM_VARIABLE
from kda_reference.recurrent import kda_recurrent
from kda_reference.run import CHUNKED_FROM_TOKENS, reference_form

CPU = torch.device("cpu")
# The GPU runs the same algebra through other kernels (cuBLAS, cuSOLVER): the equality is checked there too.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.abs().max()) if b.numel() else 0.0
    return float((a - b).abs().max()) / max(scale, 1e-300) if a.numel() else 0.0


def both(case: Case, chunk_size: int = 64, device: str = "cpu", block_elements: int | None = None):
    inputs = materialize(case, device)
    loop = kda_recurrent(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, inputs.options)
    x = inputs
    chunked = kda_chunked(x.q, x.k, x.v, x.g, x.beta, x.options, chunk_size=chunk_size, block_elements=block_elements)
    return loop, chunked


# Blocks of one step (a chunk of every sequence still going on) and of a few chunks: the exact form in
# bounded memory carries the states across blocks.
BLOCKS = [None, 1, 3 * 64 * 32 * 2]


BASE = Case(seq_lens=(70,), num_heads=2, num_v_heads=2, head_k_dim=32, head_v_dim=16, dtype="fp32")
AXES = {
    "one sequence": BASE,
    "packed with zero-length members": BASE.replace(seq_lens=(0, 37, 0, 130, 17, 0), packed=True),
    "batch rows": BASE.replace(seq_lens=(65, 65)),
    "gva": BASE.replace(num_v_heads=4),
    "v-first state": BASE.replace(state_layout="v_first", initial_state="random"),
    "large initial state": BASE.replace(initial_state="large"),
    "strong gates": BASE.replace(gate_regime="strong", seq_lens=(200,)),
    "weak gates, correlated keys": BASE.replace(
        gate_regime="weak", lower_bound=-0.01, key_regime="correlated", key_rho=0.99
    ),
    "repeated keys, beta near one": BASE.replace(key_regime="repeated", beta_regime="near_one"),
    "softplus gate": BASE.replace(gate="softplus", lower_bound=None, safe_gate=False),
    "precomputed log gate": BASE.replace(gate="log", lower_bound=None, safe_gate=False, gate_regime="strong"),
    "bf16 state": BASE.replace(dtype="bf16", state_dtype="bf16", initial_state="random"),
    "checkpoints on and off the grid": BASE.replace(
        seq_lens=(130, 0, 64),
        packed=True,
        initial_state="random",
        checkpoints=((0, 0), (0, 1), (0, 63), (0, 64), (0, 65), (0, 130), (1, 0), (2, 64), (2, 16)),
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_elements", BLOCKS)
@pytest.mark.parametrize("name", list(AXES))
def test_chunked_equals_token_loop(name: str, device: str, block_elements: int | None) -> None:
    loop, chunked = both(AXES[name], device=device, block_elements=block_elements)
    assert relative(chunked.o, loop.o) <= 1e-10
    assert relative(chunked.final_state, loop.final_state) <= 1e-10
    assert relative(chunked.checkpoint_states, loop.checkpoint_states) <= 1e-10


@pytest.mark.parametrize("chunk_size", [1, 16, 33])
def test_any_chunk_size_gives_the_same_answer(chunk_size: int) -> None:
    loop, chunked = both(AXES["checkpoints on and off the grid"], chunk_size)
    assert relative(chunked.o, loop.o) <= 1e-10
    assert relative(chunked.checkpoint_states, loop.checkpoint_states) <= 1e-10


# Every axis the sweeps draw (packing with zero-length members, GVA, both layouts, state dtypes, every gate
# form and regime, key and beta regimes, initial states, checkpoints), at sizes that cross several chunks.
EVERY_AXIS = Profile("forms", 40, 400, 1, 4, 4, (16, 32), DTYPES, True, False)


@settings(
    max_examples=EVERY_AXIS.max_examples,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_elements", [None, 1])
@given(case=cases(EVERY_AXIS))
def test_chunked_equals_token_loop_on_drawn_cases(device: str, block_elements: int | None, case: Case) -> None:
    loop, chunked = both(case, device=device, block_elements=block_elements)
    assert relative(chunked.o, loop.o) <= 1e-10
    assert relative(chunked.final_state, loop.final_state) <= 1e-10
    assert relative(chunked.checkpoint_states, loop.checkpoint_states) <= 1e-10


@pytest.mark.parametrize(
    ("per_token", "pairwise"),
    [(-0.5, False), (-15.0, False), (-FACTORED_SPAN / DEFAULT_CHUNK * 1.01, True), (-40.0, True)],
)
def test_gate_ranges_on_both_sides_of_the_factored_span(
    per_token: float, pairwise: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Per-key decays from none to per_token, weak for the first 40 tokens: chunk ranges of G up to
    # 64 x |per_token|, so with strong gates the float64 form factors some (chunk, head) pairs and
    # builds the pairwise decays for the others, within one call.
    case = BASE.replace(
        gate="log",
        lower_bound=None,
        safe_gate=False,
        seq_lens=(150, 0, 90),
        packed=True,
        initial_state="random",
        checkpoints=((0, 100), (2, 64), (2, 90)),
    )
    inputs = materialize(case, CPU)
    ramp = torch.linspace(0.0, 1.0, inputs.g.shape[-1], dtype=torch.float64)
    g = (per_token * ramp).expand_as(inputs.g).clone()
    g[:, :40] *= 0.01
    built = []
    real_pairwise = chunked_module._pairwise
    monkeypatch.setattr(
        chunked_module, "_pairwise", lambda q, *rest: built.append(q.shape[0]) or real_pairwise(q, *rest)
    )
    loop = kda_recurrent(inputs.q, inputs.k, inputs.v, g, inputs.beta, inputs.options)
    chunked = kda_chunked(inputs.q, inputs.k, inputs.v, g, inputs.beta, inputs.options)
    total_pairs = 5 * case.num_v_heads  # chunks of 150 and 90 tokens
    assert (0 < sum(built) < total_pairs) if pairwise else not built
    assert torch.isfinite(chunked.o).all()
    assert relative(chunked.o, loop.o) <= 1e-10
    assert relative(chunked.final_state, loop.final_state) <= 1e-10
    assert relative(chunked.checkpoint_states, loop.checkpoint_states) <= 1e-10


def test_gate_as_strong_as_float64_allows_stays_finite() -> None:
    # 64 tokens of log decay -100 each: exp(G_t) underflows to 0, exp(G_t - G_s) never overflows.
    case = BASE.replace(gate="log", lower_bound=None, safe_gate=False, seq_lens=(128,))
    inputs = materialize(case, CPU)
    g = torch.full_like(inputs.g, -100.0)
    loop = kda_recurrent(inputs.q, inputs.k, inputs.v, g, inputs.beta, inputs.options)
    chunked = kda_chunked(inputs.q, inputs.k, inputs.v, g, inputs.beta, inputs.options)
    assert torch.isfinite(chunked.o).all()
    assert relative(chunked.o, loop.o) <= 1e-10


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_auto_takes_the_loop_for_short_cases_and_chunked_from_the_threshold(device: str) -> None:
    short = materialize(BASE.replace(seq_lens=(CHUNKED_FROM_TOKENS - 1,)), device)
    long = materialize(BASE.replace(seq_lens=(CHUNKED_FROM_TOKENS,)), device)
    assert reference_form(short) == "loop" and reference_form(long) == "chunked"
    assert reference_form(short, "chunked") == "chunked" and reference_form(long, "loop") == "loop"
    with pytest.raises(ValueError, match=r"form=.fast.* auto, loop, chunked"):
        reference_form(short, "fast")


def test_the_environment_sets_the_form_auto_stands_for(monkeypatch: pytest.MonkeyPatch) -> None:
    long = materialize(BASE.replace(seq_lens=(CHUNKED_FROM_TOKENS,)), CPU)
    monkeypatch.setenv(FORM_VARIABLE, "loop")
    assert reference_form(long) == "loop" and reference_form(long, "chunked") == "chunked"
    monkeypatch.setenv(FORM_VARIABLE, "fast")
    with pytest.raises(ValueError, match=r"KDA_REFERENCE_FORM='fast' .* auto, loop, chunked"):
        reference_form(long)


def test_bad_chunk_size_and_working_dtype_are_named() -> None:
    inputs = materialize(BASE, CPU)
    args = (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        kda_chunked(*args, chunk_size=0)
    with pytest.raises(ValueError, match="working_dtype must be None, bfloat16, float16 or float32"):
        kda_chunked(*args, working_dtype=torch.int8)


@pytest.mark.parametrize(("dtype", "low", "high"), [("bf16", 2e-4, 2e-2), ("fp16", 2e-5, 2e-3), ("fp32", 1e-9, 1e-5)])
def test_working_precision_baseline_errs_at_its_dtype_level(dtype: str, low: float, high: float) -> None:
    # The baseline must cost what its precision costs: not exact (then every budget would sit on
    # the floor), not broken. The bounds bracket the unit roundoff of each dtype generously.
    case = BASE.replace(dtype=dtype, seq_lens=(130,), initial_state="random")
    inputs = materialize(case, CPU)
    truth = kda_recurrent(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, inputs.options)
    out = TorchChunk().run(inputs)
    assert out.o.dtype == inputs.q.dtype and out.final_state.dtype == torch.float32
    error = float((out.o.double() - truth.o).abs().max())
    assert low < error < high
