"""Declared working precisions (kernels/protocol.py WorkingPrecision): a backend that keeps its state in bf16
by its documented design, or computes its float32 matmuls in TF32, is judged against the baseline at that
precision, every record keeping its ratio to the strict limits; a planted bug on top is still caught; a
declaration that hides nothing is reported; a declaration holds only where the library states it."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from suite_paths import PLUGINS

from kda_cases.case import Case
from kda_cases.materialize import materialize
from kda_conformance.cli import main
from kda_conformance.running.truth import declared_precision
from kda_kernels import registry
from kda_kernels.protocol import WorkingPrecision
from kda_kernels.torch_chunk import TorchChunk
from kda_reference.run import run_reference
from kda_reports.precision import precision_costs

BACKENDS = (
    "declared_bf16_state",
    "undeclared_bf16_state",
    "declared_bf16_state_and_a_bug",
    "declared_needlessly",
    "declared_tf32_dots",
    "undeclared_tf32_dots",
    "declared_tf32_dots_and_twice_its_error",
    "chunks_of_128",
    "chunks_of_128_and_twice_its_error",
)


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    out = tmp_path_factory.mktemp("declared")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(PLUGINS))
        chosen = [arg for name in BACKENDS for arg in ("--backend", name)]
        code = main(["run", "--device", "cpu", "--plugin", "kda_declared", *chosen, "--out", str(out),
                     "--no-dashboard"])  # fmt: skip
    assert code == 1  # the planted bugs and the undeclared designs fail
    [parquet] = (out / "runs").glob("*.parquet")
    return pd.read_parquet(parquet)


def _verdicts(records: pd.DataFrame, backend: str) -> set[str]:
    return set(records[records["backend"] == backend]["verdict"])


@pytest.mark.slow
def test_a_declared_state_precision_passes_where_only_the_states_rounding_differs(records: pd.DataFrame) -> None:
    assert _verdicts(records, "declared_bf16_state") == {"pass"}
    # The same kernel undeclared fails its fp32 cases: the declaration is what moved the verdicts.
    undeclared = records[records["backend"] == "undeclared_bf16_state"]
    assert set(undeclared[undeclared["case_dtype"] == "fp32"]["verdict"]) == {"fail"}
    declared = records[records["backend"] == "declared_bf16_state"]
    assert set(declared["precision"]) == {"bf16 state every 16 tokens"}
    # Each record keeps what the design costs against the strict limits.
    assert declared["strict_ratio"].max() > 100 and undeclared["strict_ratio"].isna().all()


def test_a_planted_bug_on_top_of_a_declared_precision_is_caught(records: pd.DataFrame) -> None:
    bug = records[records["backend"] == "declared_bf16_state_and_a_bug"]
    failed = bug[bug["verdict"] == "fail"]
    assert not failed.empty and set(failed["tensor"]) == {"o"}


def test_the_cost_of_a_declaration_and_a_needless_one_are_reported(records: pd.DataFrame) -> None:
    costs = precision_costs(records).set_index("backend")
    assert "x the strict limits at worst" in costs.loc["declared_bf16_state", "note"]
    assert costs.loc["declared_bf16_state", "over_strict"] > 0
    assert "the declaration is unnecessary" in costs.loc["declared_needlessly", "note"]
    assert "undeclared_bf16_state" not in costs.index


def test_a_declaration_is_unnecessary_only_on_the_input_dtypes_judged() -> None:
    """On an H100 (night-1217) every fp32 configuration of FLA's chunk-32 path crashed, and the page called its
    TF32 declaration unnecessary from bf16 and fp16 records alone: it now says which were judged."""
    rows = [
        {"backend": "b", "precision": "tf32-truncated dots", "verdict": "pass", "strict_ratio": 0.9, "ratio": 0.5,
         "rel_rms_ratio": 0.4, "case_dtype": dtype}
        for dtype in ("bf16", "fp16")
    ]  # fmt: skip
    note = precision_costs(pd.DataFrame(rows)).set_index("backend").loc["b", "note"]
    assert note.endswith("the declaration is unnecessary on bf16, fp16 inputs; no fp32 record was judged"), note
    every = [*rows, {**rows[0], "case_dtype": "fp32"}]
    note = precision_costs(pd.DataFrame(every)).set_index("backend").loc["b", "note"]
    assert note.endswith("the declaration is unnecessary"), note


def test_the_declared_baseline_keeps_its_state_in_the_declared_dtype() -> None:
    case = Case(seq_lens=(50,), dtype="fp32", initial_state="random", head_k_dim=16, head_v_dim=16)
    inputs = materialize(case, torch.device("cpu"))
    precision = WorkingPrecision("bf16", 16, "a test")
    final = TorchChunk.at_precision(precision).run(inputs).final_state
    assert torch.equal(final, final.to(torch.bfloat16).float())  # rounded as it left the last chunk
    strict = TorchChunk().run(inputs).final_state
    assert not torch.equal(strict, strict.to(torch.bfloat16).float())


def test_flashkda_declares_its_documented_state_precision() -> None:
    for name in ("flashkda_cuda", "fla_chunk_dispatch"):
        precision = registry.get(name).working_precision
        assert precision is not None and (precision.state_dtype, precision.chunk) == ("bf16", 16)
        assert "flashkda-v1-deep-dive.md" in precision.source and "section 3" in precision.source
    with pytest.raises(ValueError, match="source"):
        WorkingPrecision("bf16", 16, " ")


def test_tf32_dots_declared_pass_their_fp32_cases_with_their_cost_shown(records: pd.DataFrame) -> None:
    declared = records[records["backend"] == "declared_tf32_dots"]
    assert set(declared["verdict"]) == {"pass"} and set(declared["precision"]) == {"tf32 dots"}
    fp32 = declared[declared["case_dtype"] == "fp32"]
    assert fp32["strict_ratio"].max() > 100  # TF32's 10-bit mantissa against float32's limits
    undeclared = records[records["backend"] == "undeclared_tf32_dots"]
    assert set(undeclared[undeclared["case_dtype"] == "fp32"]["verdict"]) == {"fail"}
    costs = precision_costs(records).set_index("backend")
    assert costs.loc["declared_tf32_dots", "over_strict"] > 0


def test_a_kernel_worse_than_its_declared_tf32_design_still_fails(records: pd.DataFrame) -> None:
    worse = records[records["backend"] == "declared_tf32_dots_and_twice_its_error"]
    failed = worse[(worse["verdict"] == "fail") & (worse["case_dtype"] == "fp32")]
    assert not failed.empty and failed["rel_rms_ratio"].min() > 1.2
    # Its failures are findings, not the design's cost: the cost table reads only the records that meet it.
    cost = precision_costs(records).set_index("backend").loc["declared_tf32_dots_and_twice_its_error"]
    met = pd.to_numeric(worse[worse["verdict"] == "pass"]["strict_ratio"], errors="coerce").dropna()
    beyond = int(worse["verdict"].isin(["fail", "known", "error"]).sum())
    assert cost["records"] == len(met) and beyond > 0 and f"{beyond} records past the declared limits" in cost["note"]
    if len(met):
        assert cost["worst_strict"] == met.max()


def test_a_kernel_in_128_token_chunks_is_held_to_what_its_chunk_costs_the_baseline(records: pd.DataFrame) -> None:
    # The first sweep's T130 fp32 lb-5 went red on the baseline's own algebra at chunk 128 against chunk 64's
    # limits (final state max-abs 1.96x): a correct kernel's chunk choice, now judged at its chunk.
    chunked = records[records["backend"] == "chunks_of_128"]
    assert set(chunked["verdict"]) == {"pass"} and set(chunked["precision"]) == {"128-token chunks"}
    fp32 = chunked[chunked["case_dtype"] == "fp32"]
    assert pd.to_numeric(fp32["strict_ratio"]).max() > 1.5  # what the chunk costs against chunk 64's limits
    worse = records[records["backend"] == "chunks_of_128_and_twice_its_error"]
    assert not worse[(worse["verdict"] == "fail") & (worse["case_dtype"] == "fp32")].empty


def test_only_a_chunk_larger_than_the_baselines_moves_the_baseline() -> None:
    cpu = torch.device("cpu")
    chunked = declared_precision(TorchChunk(chunk_size=128), cpu)
    assert chunked is not None and chunked.chunk == 128 and chunked.label == "128-token chunks"
    assert declared_precision(TorchChunk(chunk_size=32), cpu) is None
    assert declared_precision(TorchChunk(), cpu) is None
    # A declared design keeps what it declares, at the larger chunk.
    tf32 = TorchChunk(chunk_size=128)
    tf32.working_precision = WorkingPrecision(dots="tf32", source="a test")
    both = declared_precision(tf32, cpu)
    assert both is not None and (both.dots, both.chunk, both.label) == ("tf32", 128, "tf32 dots, 128-token chunks")
    with pytest.raises(ValueError, match="declares nothing"):
        WorkingPrecision(chunk=64, source="a test")


def test_the_baselines_algebra_errs_more_in_128_token_chunks_than_in_64() -> None:
    """The measurement docs/tolerance.md quotes: fp32 final states of T130 lb-5 H2/2 K=V=64, six seeds."""
    ratios = []
    for seed in range(6):
        case = Case(seq_lens=(130,), dtype="fp32", num_heads=2, num_v_heads=2, head_k_dim=64, head_v_dim=64,
                    gate="lower_bound", lower_bound=-5.0, safe_gate=True, seed=seed)  # fmt: skip
        inputs = materialize(case, torch.device("cpu"))
        truth = run_reference(inputs, "loop").final_state
        errors = [(TorchChunk(chunk).run(inputs).final_state.double() - truth).abs().max() for chunk in (64, 128)]
        ratios.append(float(errors[1] / errors[0]))
    print("chunk 128 / chunk 64, final state max-abs:", [f"{r:.2f}" for r in ratios])
    assert min(ratios) > 1.0


def test_a_declaration_holds_only_on_its_platforms_and_library_versions() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    nvidia = WorkingPrecision(dots="tf32", source="a test", platforms=("nvidia",), versions=("0.6.0",))
    assert not nvidia.holds_on(cpu, "0.6.0")  # Triton's CPU interpreter computes IEEE dots
    if torch.version.hip is None:
        assert nvidia.holds_on(gpu, "0.6.0") and not nvidia.holds_on(gpu, "0.7.0")
    assert nvidia.holds_on.__doc__ and WorkingPrecision(dots="tf32", source="a test").holds_on(cpu, "")
    assert nvidia.label == "tf32 dots" and nvidia.unit_roundoff == 2.0**-11
    with pytest.raises(ValueError, match="declares nothing"):
        WorkingPrecision(source="a test")
    with pytest.raises(ValueError, match="platforms"):
        WorkingPrecision(dots="tf32", source="a test", platforms=("tpu",))


def test_a_commit_declared_short_holds_for_the_source_tree_that_records_it_in_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an H100 (2026-12-06) AITER's default pipeline went red at 334x the strict fp32 limits, its TF32 design
    not applied: the source tree's COMMIT file held the full hash, the declaration cites ``e4048607a5``."""
    aiter = registry.get("aiter_default")
    declared = aiter.working_precision
    assert declared is not None and declared.versions == ("e4048607a5",)
    gpu = torch.device("cuda")
    if torch.version.hip is None:
        full = "e4048607a535ace3a2b51ded31b1c8c2d45c0879"
        for recorded in (full, full[:10], full[:7]):
            assert declared.holds_on(gpu, f"{recorded} (KDA_AITER_SRC)"), recorded
        for other in ("e4048607b535ace3a2b51ded31b1c8c2d45c0879", "e40486", "unknown (KDA_AITER_SRC)", ""):
            assert not declared.holds_on(gpu, other), other
        fla = WorkingPrecision.tf32_on_nvidia("a test", "0.6.0")
        assert fla.holds_on(gpu, "0.6.0") and not fla.holds_on(gpu, "0.6.01")
        tree = tmp_path / "aiter_src"
        tree.mkdir()
        (tree / "COMMIT").write_text(full + "\n")
        monkeypatch.setenv("KDA_AITER_SRC", str(tree))
        from kda_conformance.running import truth

        truth._version.cache_clear()
        try:
            assert declared_precision(aiter, gpu) == declared
        finally:
            truth._version.cache_clear()


def test_the_libraries_that_state_tf32_dots_declare_them_with_the_line_that_states_it() -> None:
    for name in ("fla_chunk", "fla_chunk32"):
        precision = registry.get(name).working_precision
        assert precision is not None and precision.dots == "tf32-truncated" and precision.platforms == ("nvidia",)
        assert "fla/ops/kda/chunk_intra.py" in precision.source and "0.6.0" in precision.versions
    assert registry.get("fla_recurrent").working_precision is None


def test_triton_tf32_dots_cut_their_operands_and_the_baseline_cuts_them_too() -> None:
    """Triton hands float32 registers to NVIDIA's TF32 tensor cores, which drop the low 13 mantissa bits
    (triton-lang/triton#4574): the declared design's baseline cuts them toward zero, where cuBLAS rounds."""
    from kda_reference.chunked import round_to_tf32

    x = torch.tensor([1 + 2**-11, 1 + 2**-10 + 2**-12, -(1 + 2**-11 + 2**-13), float("inf")])
    assert round_to_tf32(x, truncate=True).tolist() == [1.0, 1 + 2**-10, -1.0, float("inf")]
    assert round_to_tf32(x).tolist() == [1.0, 1 + 2**-10, -(1 + 2**-10), float("inf")]  # ties to even
    design = registry.get("fla_chunk").working_precision
    assert design.label == "tf32-truncated dots" and design.unit_roundoff == 2.0**-10
    assert TorchChunk.at_precision(design).tf32_dots == "truncated"
    with pytest.raises(ValueError, match="tf32_dots must be"):
        TorchChunk(tf32_dots="stochastic").run(materialize(Case(seq_lens=(4,), dtype="fp32"), torch.device("cpu")))


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.version.hip is not None, reason="needs an NVIDIA GPU (Triton's TF32 dots)"
)
def test_on_an_nvidia_gpu_tritons_tf32_dot_is_the_product_of_cut_operands() -> None:
    """What ``dots="tf32-truncated"`` models, measured on the GPU itself (H200, Triton 3.6, 2026-12-05: a
    64x64 tl.dot in TF32 was 8e-6 at most from the float64 product of cut operands, 2.6e-2 from that of
    rounded ones)."""
    import triton
    import triton.language as tl

    from kda_reference.chunked import round_to_tf32

    @triton.jit
    def dot(a, b, c, N: tl.constexpr):
        r = tl.arange(0, N)
        tile_a = tl.load(a + r[:, None] * N + r[None, :])
        tile_b = tl.load(b + r[:, None] * N + r[None, :])
        tl.store(c + r[:, None] * N + r[None, :], tl.dot(tile_a, tile_b, input_precision="tf32"))

    generator = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(64, 64, device="cuda", generator=generator) for _ in range(2))
    c = torch.empty(64, 64, device="cuda")
    dot[(1,)](a, b, c, 64)
    cut = round_to_tf32(a, truncate=True).double() @ round_to_tf32(b, truncate=True).double()
    rounded = round_to_tf32(a).double() @ round_to_tf32(b).double()
    assert (c.double() - cut).abs().max() < 1e-4 < 1e-3 < (c.double() - rounded).abs().max()
