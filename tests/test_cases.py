"""The Case type: validation, stable ids, JSON round trip, bit-identical materialization."""

from __future__ import annotations

import hashlib
import re

import pytest
import torch

from kda_cases.case import INPUT_LAYOUTS, Case
from kda_cases.materialize import drawn_on_cpu, materialize


def test_id_is_stable_across_machines_and_versions() -> None:
    # Pinned: if this changes, every stored report and corpus entry loses its meaning.
    # Bump GENERATOR_VERSION (and update this) only when materialize() draws differently.
    assert Case().id == "kda-69ea257332f0"


def test_id_ignores_tags_but_not_axes() -> None:
    base = Case(seq_lens=(37,))
    assert base.replace(tags=("x",)).id == base.id
    assert base.replace(seed=1).id != base.id
    assert base.replace(dtype="fp32").id != base.id


def test_json_round_trip() -> None:
    case = Case(
        seq_lens=(5, 0, 9),
        packed=True,
        checkpoints=((0, 2), (2, 9)),
        initial_state="random",
        state_layout="v_first",
        gate="softplus",
        lower_bound=None,
        safe_gate=False,
        tags=("corpus",),
    )
    again = Case.from_json(case.to_json())
    assert again == case and again.id == case.id and again.tags == case.tags


def test_json_with_wrong_id_is_rejected() -> None:
    data = Case().to_dict() | {"id": "kda-000000000000"}
    with pytest.raises(ValueError, match="says id"):
        Case.from_dict(data)


def test_unknown_field_is_named() -> None:
    with pytest.raises(ValueError, match="unknown Case fields \\['colour'\\]"):
        Case.from_dict(Case().to_dict() | {"colour": "red"})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(dtype="fp8"), "dtype='fp8' is not allowed; choose one of bf16, fp16, fp32"),
        (dict(seq_lens=(3, 4)), "set packed=True"),
        (dict(seq_lens=(0,)), "zero-length"),
        (dict(num_v_heads=3), "multiple of num_heads"),
        (dict(gate="lower_bound", lower_bound=None, safe_gate=False), "lower_bound < 0"),
        (dict(state_layout="kv"), "state_layout='kv'"),
        (dict(checkpoints=((0, 65),)), "outside sequence 0"),
        (dict(seq_lens=(-1,)), ">= 0"),
        (dict(seq_lens="abc"), "seq_lens must be a list, got 'abc'"),
        (dict(seq_lens=("abc",)), "seq_lens must be an integer, got 'abc'"),
        (dict(num_heads=1.5), "num_heads must be an integer, got 1.5"),
        (dict(scale=float("nan")), "scale must be a finite number, got nan"),
        (dict(scale=float("inf")), "scale must be a finite number, got inf"),
        (dict(scale=0.0), "scale must be a finite number > 0"),
        (dict(lower_bound=float("-inf")), "lower_bound must be a finite number, got -inf"),
        (dict(packed="yes"), "packed must be true or false, got 'yes'"),
        (dict(checkpoints=((0,),)), "checkpoints must be (sequence, tokens) pairs"),
        # A run's parquet stores integers in 64 bits: a larger seed broke its writer after every case had run.
        (dict(seed=2**70), "seed must be within +-(2^63 - 1), got 1180591620717411303424..."),
        (dict(seed=10**400), "seed must be within +-(2^63 - 1)"),
        (dict(seed=-3), "seed must be >= 0, got -3"),
        (dict(tags={"a": 1}), "tags must be a list, got {'a': 1}"),
        (dict(tags=("ok", {"a": 1})), "tags must be a list of strings"),
    ],
)
def test_bad_case_names_the_argument(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Case(**changes)


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if t is not None:
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def test_materialize_is_bit_identical_and_shaped() -> None:
    case = Case(
        seq_lens=(7, 0, 5),
        packed=True,
        num_heads=2,
        num_v_heads=4,
        head_k_dim=8,
        head_v_dim=4,
        initial_state="random",
        state_layout="v_first",
        dtype="bf16",
    )
    a, b = materialize(case), materialize(case)
    fields = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens")
    assert _digest(getattr(a, f) for f in fields) == _digest(getattr(b, f) for f in fields)
    assert a.q.shape == (1, 12, 2, 8) and a.v.shape == (1, 12, 4, 4) and a.g.shape == (1, 12, 4, 8)
    assert a.beta.shape == (1, 12, 4) and a.initial_state.shape == (3, 4, 4, 8)
    assert a.cu_seqlens.tolist() == [0, 7, 7, 12]
    assert a.q.dtype == torch.bfloat16 and a.initial_state.dtype == torch.float32
    assert a.A_log.dtype == torch.float32 and a.dt_bias.shape == (32,)


def test_materialize_pinned_bits() -> None:
    # Same id, same inputs on every machine: pinned digest of a small case's tensors.
    inp = materialize(Case(seq_lens=(16,), initial_state="random"))
    assert _digest([inp.q, inp.k, inp.v, inp.g, inp.beta, inp.initial_state]) == "ac758d2eec04474e"


def test_regimes_shape_the_gates() -> None:
    from kda_reference.preprocess import gate_activation

    def decay(regime: str) -> torch.Tensor:
        inp = materialize(Case(seq_lens=(64,), gate_regime=regime))
        return gate_activation(
            inp.g.double(), in_kernel=True, A_log=inp.A_log.double(), dt_bias=inp.dt_bias.double(), lower_bound=-5.0
        )

    assert decay("weak").mean() > -0.05
    assert decay("strong").mean() < -4.5
    assert -5.0 <= decay("typical").min() and decay("typical").max() < 0


def test_correlated_keys_have_the_asked_correlation() -> None:
    inp = materialize(Case(seq_lens=(512,), key_regime="correlated", key_rho=0.9, dtype="fp32", l2norm_in_kernel=False))
    k = inp.k[0, :, 0]
    cos = (k[1:] * k[:-1]).sum(-1)
    assert 0.8 < cos.mean() < 0.95


def test_long_cases_cover_every_dtype_and_change_with_the_seed() -> None:
    from kda_cases.grids import long_cases

    dtypes = ("bf16", "fp16", "fp32", "bf16")
    night = long_cases(dtypes, 131072, seed=7)
    assert [c.dtype for c in night] == list(dtypes)
    assert all(c.total_tokens == 131072 and "long" in c.tags for c in night)
    assert [c.id for c in night] == [c.id for c in long_cases(dtypes, 131072, seed=7)]
    assert {c.id for c in night}.isdisjoint(c.id for c in long_cases(dtypes, 131072, seed=8))
    drawn = [c for seed in range(20) for c in long_cases(dtypes, 4096, seed)]
    assert {c.packed for c in drawn} == {False, True}
    assert len({c.gate_regime for c in drawn}) > 1 and len({c.initial_state for c in drawn}) > 1


def test_equal_cases_have_one_id_whatever_the_number_types() -> None:
    as_float = Case(seq_lens=[40], lower_bound=-5.0, key_rho=0.0, num_heads=2)
    as_int = Case(seq_lens=(40.0,), lower_bound=-5, key_rho=0, num_heads=2.0)
    assert as_int == as_float and as_int.id == as_float.id
    assert Case.from_json('{"seq_lens": [40], "lower_bound": -5}').id == as_float.id


def test_case_json_must_give_the_lengths() -> None:
    with pytest.raises(ValueError, match="case JSON must give seq_lens"):
        Case.from_json('{"dtype": "bf16"}')


def test_a_fused_case_hands_views_of_one_projection_buffer_with_the_contiguous_values() -> None:
    """q, k, v sliced from one [B, T, (2K + V) heads] buffer and g, beta from another, as vLLM's and SGLang's
    layers split their fused projections: the server's strides, the contiguous case's values."""
    case = Case(seq_lens=(7, 0, 5), packed=True, num_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=16)
    plain, fused = materialize(case), materialize(case.replace(input_layout="fused"))
    width = 2 * 2 * 8 + 4 * 16  # q, k, v of one token side by side
    assert fused.q.stride() == (12 * width, width, 8, 1) and fused.v.stride() == (12 * width, width, 16, 1)
    assert fused.k.data_ptr() - fused.q.data_ptr() == 2 * 8 * fused.q.element_size(), "k right after q"
    assert fused.q.untyped_storage().data_ptr() == fused.v.untyped_storage().data_ptr(), "one buffer"
    assert fused.g.stride()[1] == fused.beta.stride()[1] == 4 * 8 + 4, "g and beta: one gate projection"
    for name in ("q", "k", "v", "g", "beta"):
        assert not getattr(fused, name).is_contiguous(), name
        assert torch.equal(getattr(fused, name), getattr(plain, name)), name
    assert fused.case.id != case.id and "fused" in fused.case.label


def test_a_head_major_case_hands_transposed_views_and_a_contiguous_case_keeps_its_id() -> None:
    case = Case(seq_lens=(9,), num_heads=2, num_v_heads=2, head_k_dim=8, head_v_dim=4)
    plain, head_major = materialize(case), materialize(case.replace(input_layout="head_major"))
    assert head_major.q.stride() == (2 * 9 * 8, 8, 9 * 8, 1) and head_major.beta.stride() == (2 * 9, 1, 9)
    assert all(torch.equal(getattr(head_major, n), getattr(plain, n)) for n in ("q", "k", "v", "g", "beta"))
    # The axis came after cases were pinned and ledgered: at its default the id is what it was.
    assert Case().replace(input_layout="contiguous").id == "kda-69ea257332f0"
    with pytest.raises(ValueError, match="input_layout='rows' is not allowed; choose one of contiguous, fused"):
        Case(input_layout="rows")


def test_magnitude_regimes_scale_v_and_normalized_queries_and_keys_only() -> None:
    """``large``: v x10 to x100 (q and k too where the kernel normalizes them); ``outliers``: a few tokens
    and channels x100 to x1000, the rest as drawn; representable in fp16 (unit queries beside scaled values:
    on the H200 scaled queries made the fp16 baseline overflow); a typical case keeps its id and bits."""
    case = Case(seq_lens=(200,), num_heads=2, num_v_heads=2, dtype="fp16", l2norm_in_kernel=False)
    plain = materialize(case)
    large, outliers = (materialize(case.replace(input_scale=s)) for s in ("large", "outliers"))
    ratio = large.v.float().abs().amax() / plain.v.float().abs().amax()
    assert 10 <= ratio <= 100 and torch.equal(large.k, plain.k), "unit keys unscaled without the kernel's l2norm"
    assert torch.equal(large.q, plain.q) and torch.equal(outliers.q, plain.q), "and unit queries"
    changed = outliers.v != plain.v
    assert 0 < changed.float().mean() < 0.1 and bool(torch.isfinite(outliers.v).all()), "a few, and representable"
    factor = (outliers.v.float()[changed] / plain.v.float()[changed]).abs()
    assert 99 <= float(factor.min()) and float(factor.max()) <= 1001, "x100 to x1000; the rest as drawn"
    normalized = materialize(case.replace(l2norm_in_kernel=True, input_scale="large"))
    assert (
        normalized.k.float().abs().amax() > 10 * materialize(case.replace(l2norm_in_kernel=True)).k.float().abs().amax()
    )
    assert Case().replace(input_scale="typical").id == "kda-69ea257332f0" and "x:outliers" in outliers.case.label


@pytest.mark.parametrize("layout", INPUT_LAYOUTS)
def test_inputs_drawn_ahead_on_the_cpu_are_the_same_bits_in_the_same_layout(layout: str) -> None:
    """A run draws a case's tensors before it takes its share of the GPU (conformance/running/truth_cache.py):
    placing them later must give what materialize gives, strides included."""
    case = Case(seq_lens=(40, 0, 25), packed=True, num_heads=2, num_v_heads=4, initial_state="random",
                input_layout=layout, input_scale="outliers", dtype="fp16")  # fmt: skip
    whole, placed = materialize(case), materialize(case, "cpu", drawn_on_cpu(case))
    for name in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"):
        a, b = getattr(whole, name), getattr(placed, name)
        assert torch.equal(a, b) and a.stride() == b.stride() and a.dtype == b.dtype, name
    with pytest.raises(ValueError, match="drawn: tensors of case"):
        materialize(case.replace(seed=1), "cpu", drawn_on_cpu(case))


def test_the_truth_cache_uses_what_it_drew_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    from kda_conformance.running import truth_cache

    drawn: list[str] = []
    original = truth_cache.drawn_on_cpu
    monkeypatch.setattr(truth_cache, "drawn_on_cpu", lambda case: drawn.append(case.id) or original(case))
    cache = truth_cache.TruthCache(torch.device("cpu"))
    case = Case(seq_lens=(20,))
    cache.draw_ahead(case)
    truth = cache.get(case)
    assert drawn == [case.id] and torch.equal(truth.inputs.v, materialize(case).v)
    cache.draw_ahead(case)  # kept: nothing to draw
    assert drawn == [case.id] and not cache._drawn


def test_the_truth_cache_keeps_a_property_tests_examples_for_the_next_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A check's test draws the same cases for every backend, one backend's examples after another's (25 in the
    detection runs): the second backend's truths are the first's, none computed again, within the bytes bound."""
    from kda_conformance.running import truth_cache

    made: list[str] = []
    original = truth_cache.case_truth
    monkeypatch.setattr(
        truth_cache, "case_truth", lambda case, *a, **k: made.append(case.id) or original(case, *a, **k)
    )
    cache = truth_cache.TruthCache(torch.device("cpu"))
    cases = [Case(seq_lens=(8 + i,), head_k_dim=16, head_v_dim=16) for i in range(25)]
    for _backend in range(2):
        for case in cases:
            cache.get(case)
            cache.trim()
    assert made == [c.id for c in cases]
    monkeypatch.setattr(truth_cache, "TRUTH_CACHE_GIB", 0.0)  # the bytes bound still holds
    cache.trim()
    assert not cache._strict


def test_a_misspelled_field_or_value_is_told_the_closest_name() -> None:
    with pytest.raises(ValueError, match=r"unknown Case fields \['dtpye'\] \(did you mean 'dtype'\?\)"):
        Case.from_dict({"seq_lens": [3], "dtpye": "bf16"})
    with pytest.raises(ValueError, match=r"dtype='bf61' is not allowed \(did you mean 'bf16'\?\)"):
        Case(dtype="bf61")


def test_a_case_computes_its_id_once() -> None:
    """A run asked one 37-token case's id 44 times, a JSON dump and a hash each; a frozen case keeps it."""
    case = Case(seq_lens=(37,))
    assert "id" not in vars(case)
    first = case.id
    assert vars(case)["id"] is first and case.id is first
    assert case.replace(seed=case.seed + 1).id != first and case == case.replace()
