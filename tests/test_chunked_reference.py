"""The chunked float64 form against the token-loop definition, and the working-precision baseline's error level."""

from __future__ import annotations

import pytest
import torch

from kda_cases.case import Case
from kda_cases.materialize import materialize
from kda_kernels.torch_chunk import TorchChunk
from kda_reference.chunked import kda_chunked
from kda_reference.recurrent import kda_recurrent
from kda_reference.run import CHUNKED_FROM_TOKENS, reference_form

CPU = torch.device("cpu")


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.abs().max()) if b.numel() else 0.0
    return float((a - b).abs().max()) / max(scale, 1e-300) if a.numel() else 0.0


def both(case: Case, chunk_size: int = 64):  # type: ignore[no-untyped-def]
    inputs = materialize(case, CPU)
    kwargs = dict(**inputs.kernel_kwargs(), checkpoints=case.checkpoints)
    loop = kda_recurrent(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, **kwargs)
    chunked = kda_chunked(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, chunk_size=chunk_size, **kwargs)
    return loop, chunked


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


@pytest.mark.parametrize("name", list(AXES))
def test_chunked_equals_token_loop(name: str) -> None:
    loop, chunked = both(AXES[name])
    assert relative(chunked.o, loop.o) <= 1e-10
    assert relative(chunked.final_state, loop.final_state) <= 1e-10
    assert relative(chunked.checkpoint_states, loop.checkpoint_states) <= 1e-10


@pytest.mark.parametrize("chunk_size", [1, 16, 33])
def test_any_chunk_size_gives_the_same_answer(chunk_size: int) -> None:
    loop, chunked = both(AXES["checkpoints on and off the grid"], chunk_size)
    assert relative(chunked.o, loop.o) <= 1e-10
    assert relative(chunked.checkpoint_states, loop.checkpoint_states) <= 1e-10


def test_gate_as_strong_as_float64_allows_stays_finite() -> None:
    # 64 tokens of log decay -100 each: exp(G_t) underflows to 0, exp(G_t - G_s) never overflows.
    case = BASE.replace(gate="log", lower_bound=None, safe_gate=False, seq_lens=(128,))
    inputs = materialize(case, CPU)
    g = torch.full_like(inputs.g, -100.0)
    kwargs = inputs.kernel_kwargs()
    loop = kda_recurrent(inputs.q, inputs.k, inputs.v, g, inputs.beta, **kwargs)
    chunked = kda_chunked(inputs.q, inputs.k, inputs.v, g, inputs.beta, **kwargs)
    assert torch.isfinite(chunked.o).all()
    assert relative(chunked.o, loop.o) <= 1e-10


def test_long_gpu_cases_use_the_chunked_form() -> None:
    short = materialize(BASE, "meta")
    long = materialize(BASE.replace(seq_lens=(CHUNKED_FROM_TOKENS,)), "meta")
    assert reference_form(short) == "loop" and reference_form(long) == "chunked"
    assert reference_form(materialize(BASE.replace(seq_lens=(CHUNKED_FROM_TOKENS,)), CPU)) == "loop"
    assert reference_form(short, "chunked") == "chunked"
    with pytest.raises(ValueError, match=r"form=.fast.* auto, loop, chunked"):
        reference_form(short, "fast")


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
    truth = kda_recurrent(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, **inputs.kernel_kwargs())
    out = TorchChunk().run(inputs)
    assert out.o.dtype == inputs.q.dtype and out.final_state.dtype == torch.float32
    error = float((out.o.double() - truth.o).abs().max())
    assert low < error < high
