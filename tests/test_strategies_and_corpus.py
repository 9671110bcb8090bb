"""Hypothesis strategies and profiles, the committed corpus, and `kda-conformance run --profile` / `corpus add`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from kda_cases.case import Case
from kda_cases.corpus import load_corpus, save_case
from kda_cases.kernel_configs import kernel_config
from kda_cases.profiles import BOUNDARY_LENGTHS, PROFILES, get_profile
from kda_cases.strategies import cases, draw_cases, with_kernel_pool
from kda_conformance.cli import main
from kda_reports.runfile import RunRecorder, read_run


@pytest.mark.parametrize("name", list(PROFILES))
def test_drawn_cases_respect_their_profile(name: str) -> None:
    profile = get_profile(name)
    seen: list[Case] = []

    @settings(max_examples=60, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(cases(profile))
    def check(case: Case) -> None:
        seen.append(case)
        assert case.total_tokens <= profile.max_total_tokens
        assert case.max_len >= profile.min_length
        assert case.num_heads <= profile.max_heads and case.num_v_heads <= profile.value_heads_limit
        assert case.head_k_dim in profile.head_dims
        assert case.dtype in profile.dtypes
        if profile.safe_gates_only:
            assert case.safe_gate and case.lower_bound is not None
        for seq, tokens in case.checkpoints:
            assert 0 <= tokens <= case.seq_lens[seq]

    check()
    lens = {n for case in seen for n in case.seq_lens}
    assert lens & set(BOUNDARY_LENGTHS), "no boundary length drawn"


def test_the_ci_profile_reaches_every_listed_axis_value() -> None:
    """The ci profile's cases (its corpus cases and the cases its checks draw) leave no value of
    cases/coverage.py's CI_REQUIRED unreached: GVA with two query heads, fp32 and fp16 across chunk
    boundaries with and without an initial state, every regime, packing with a zero-length member, ..."""
    from kda_cases.corpus import load_corpus
    from kda_cases.coverage import coverage, unreached
    from kda_conformance.checks import CHECKS

    ci = get_profile("ci")
    drawn = draw_cases(ci.for_backend(interpreted=False), ci.max_examples * len(CHECKS))
    pinned = [e.case for e in load_corpus() if ci.corpus_skip(e.case, interpreted=True) is None]
    assert unreached(coverage([*drawn, *pinned])) == []


def test_only_interpreted_backends_are_held_to_safe_gates() -> None:
    """FLA's unsafe-gate path costs 40 to 60 s a call in Triton's interpreter, so the CPU tiers draw safe gates
    for interpreted backends; everything else draws the softplus form too (vLLM's GLM-5.3-Flash gate)."""
    ci = get_profile("ci")
    compiled = {case.gate for case in draw_cases(ci.for_backend(interpreted=False), 40)}
    interpreted = draw_cases(ci.for_backend(interpreted=True), 40)
    assert compiled == {"lower_bound", "log", "softplus"}
    assert all(case.safe_gate and case.lower_bound is not None for case in interpreted)
    assert get_profile("nightly").for_backend(interpreted=True) == get_profile("nightly")
    # And no server batches for them: the interpreter's seconds go by the program, 160 in such a batch.
    assert max(case.num_seqs for case in interpreted) <= ci.max_seqs


def test_server_sized_batches_reach_hundreds_of_programs() -> None:
    """ci drew at most 3 sequences and 16 (sequence, head) pairs; servers prefill dozens of requests."""
    ci = get_profile("ci")
    drawn = draw_cases(ci.for_backend(interpreted=False), 60)
    batches = [case for case in drawn if case.num_seqs >= 9]
    assert batches and all(case.total_tokens <= ci.max_total_tokens for case in batches)
    assert max(case.num_seqs for case in batches) >= 12
    assert max(case.num_seqs * case.num_v_heads for case in batches) > 128
    assert any(case.packed and case.has_empty_sequence for case in batches)


def test_coverage_names_what_a_set_of_cases_leaves_unreached() -> None:
    from kda_cases.case import Case
    from kda_cases.coverage import coverage, unreached

    table = coverage([Case(seq_lens=(37,), num_heads=2, num_v_heads=4)])
    assert ("heads", "GVA, H >= 2") in set(zip(table["axis"], table["value"], strict=True))
    missing = unreached(table)
    assert "dtype: fp32" in missing and "heads: GVA, H >= 2" not in missing


def test_axes_are_all_reached_in_the_nightly_profile() -> None:
    # One night draws its kernel axes from a few configurations; the nights together reach every axis.
    nightly = get_profile("nightly")
    drawn = [c for seed in range(12) for c in draw_cases(with_kernel_pool(nightly, seed), 12, seed)]
    assert {c.gate for c in drawn} == {"lower_bound", "softplus", "log"}
    assert {c.gate_regime for c in drawn} == {"typical", "weak", "strong", "reset"}
    assert {c.key_regime for c in drawn} == {"random", "correlated", "repeated"}
    assert {c.initial_state for c in drawn} == {"none", "random", "large"}
    assert {c.state_layout for c in drawn} == {"k_first", "v_first"}
    assert {c.state_dtype for c in drawn} == {"fp32", "bf16"}
    assert {c.dtype for c in drawn} == {"bf16", "fp16", "fp32"}
    assert any(c.packed and 0 in c.seq_lens for c in drawn), "no zero-length member"
    assert any(c.num_v_heads > c.num_heads for c in drawn), "no GVA"
    assert any(c.checkpoints for c in drawn)


@pytest.mark.parametrize("name", ["nightly", "long"])
def test_one_run_draws_from_its_few_kernel_configurations_within_the_work_limit(name: str) -> None:
    profile = with_kernel_pool(get_profile(name), seed=3)
    assert len(profile.kernel_pool) == profile.kernel_configs
    drawn = draw_cases(profile, 40, seed=3)
    configs = {kernel_config(c) for c in drawn}
    assert configs <= set(profile.kernel_pool)
    assert len({c.max_len for c in drawn}) > 5, "lengths must still vary within a configuration"
    assert all(c.total_tokens * c.num_v_heads * c.head_k_dim * c.head_v_dim <= profile.max_work for c in drawn)
    assert with_kernel_pool(get_profile(name), seed=3) == profile, "the seed alone decides the pool"


def test_a_seed_draws_the_same_cases_and_another_seed_others() -> None:
    nightly = get_profile("nightly")
    first, again, other = draw_cases(nightly, 5, 7), draw_cases(nightly, 5, 7), draw_cases(nightly, 5, 8)
    assert [c.id for c in first] == [c.id for c in again] != [c.id for c in other]
    assert [c.id for c in draw_cases(get_profile("ci"), 4, 1)] == [c.id for c in draw_cases(get_profile("ci"), 4, 2)]


def test_unknown_profile_is_named() -> None:
    with pytest.raises(
        ValueError, match="profile 'weekly' is not defined; choose from smoke, ci, cpu-nightly, nightly, long"
    ):
        get_profile("weekly")


def test_committed_corpus_is_valid_and_named_by_id() -> None:
    entries = load_corpus()
    assert len(entries) >= 10
    for entry in entries:
        assert entry.path.name == f"{entry.case.id}.json" and entry.why
    lengths = {entry.case.max_len for entry in entries}
    assert {37, 2048, 131072} <= lengths


def test_save_case_is_idempotent_and_bad_files_are_named(tmp_path: Path) -> None:
    case = Case(seq_lens=(5,))
    path, new = save_case(case, "why", tmp_path)
    assert new and save_case(case, "again", tmp_path) == (path, False)
    assert [e.case for e in load_corpus(tmp_path)] == [case]
    (tmp_path / "broken.json").write_text(json.dumps({"case": {"seq_lens": [3], "dtype": "int8"}}))
    with pytest.raises(ValueError, match=r"corpus file broken\.json is not a valid entry: dtype"):
        load_corpus(tmp_path)


def test_corpus_add_pins_the_failing_cases_of_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad, good = Case(seq_lens=(7,)), Case(seq_lens=(9,))
    rows = [
        {"case_id": bad.id, "case_json": bad.to_json(), "backend": "k", "tensor": "o", "verdict": "fail"},
        {"case_id": good.id, "case_json": good.to_json(), "backend": "k", "tensor": "o", "verdict": "pass"},
    ]
    recorder = RunRecorder({"device_type": "cpu"}, tmp_path / "out")
    recorder.add(rows)
    _, paths = recorder.finish()
    assert main(["corpus", "add", "--from-run", str(paths["records"]), "--dir", str(tmp_path / "corpus")]) == 0
    assert [e.case for e in load_corpus(tmp_path / "corpus")] == [bad]
    assert "added" in capsys.readouterr().out
    assert main(["corpus", "add", "--dir", str(tmp_path / "corpus")]) == 2


def test_cli_profile_run_records_profile_and_cases(tmp_path: Path) -> None:
    assert (
        main(["run", "--profile", "smoke", "--backend", "torch_chunk", "--device", "cpu", "--out", str(tmp_path)]) == 0
    )
    [path] = (tmp_path / "runs").glob("*.parquet")
    frame = read_run(path)
    assert set(frame["env_profile"]) == {"smoke"} and set(frame["env_seed"]) == {""}
    pinned = {e.case.id for e in load_corpus() if get_profile("smoke").corpus_skip(e.case, interpreted=True) is None}
    assert pinned < set(frame["case_id"])


def test_every_night_reaches_every_required_value_whatever_its_seed() -> None:
    """20 seeds: the night's guaranteed cases and its long cases reach every value of NIGHT_REQUIRED, and the
    night's drawn cases take their kernel configurations from the guaranteed ones (no compile of their own)."""
    from kda_cases.coverage import NIGHT_REQUIRED, coverage, unreached
    from kda_cases.guarantee import guaranteed_cases
    from kda_conformance.running.config import build_config

    nightly = get_profile("nightly")
    for seed in range(20):
        config = build_config(device="cpu", profile="nightly", seed=seed, backends=["torch_chunk"])
        night = config.guaranteed_cases() + config.long_cases()
        assert unreached(coverage(night), NIGHT_REQUIRED) == [], seed
        pool = set(config.profile.kernel_pool)
        assert pool == {kernel_config(c) for c in guaranteed_cases(seed)}, seed
        assert {kernel_config(c) for c in draw_cases(config.profile, 6, seed)} <= pool, seed
        assert len(config.kernel_configs()) <= nightly.max_kernel_configs, seed
        # The same kernels every night: the seed varies the inputs, never a configuration.
        assert set(config.kernel_configs()) == set(
            build_config(device="cpu", profile="nightly", seed=99).kernel_configs()
        )
    assert guaranteed_cases(3) == guaranteed_cases(3) != guaranteed_cases(4)
    # The sentinels and the long cases take the guaranteed cases' configurations or the corpus's, but one.
    from kda_cases.corpus import load_corpus
    from kda_cases.sentinels import load_sentinels

    shared = {kernel_config(c) for c in guaranteed_cases(5)} | {kernel_config(e.case) for e in load_corpus()}
    own = {kernel_config(c) for c in load_sentinels() + config.long_cases()} - shared
    assert len(own) == 1 and len(config.kernel_configs()) == nightly.max_kernel_configs == 28, own


def test_a_night_says_how_many_kernel_configurations_it_compiles() -> None:
    from kda_conformance.running.config import build_config

    config = build_config(device="cpu", profile="nightly", seed=4242, backends=["torch_chunk"])
    [line] = config.kernel_config_lines()
    assert line.startswith(f"kernel configurations: {len(config.kernel_configs())} distinct (guaranteed 11, corpus ")
    assert line.endswith(f"at most {config.profile.max_kernel_configs})")
