"""The serving harness (kernels/serving.py), its checks (conformance/serving.py) and `kda-conformance repro`.

The planted serving bugs of tests/plugins/kda_planted_bugs.py model the bug classes of KDA-FACTS.md that a
harness can show (a fresh sequence reading a stale slot, a padding row scattering into slot 0, -1 used as an
index, a checkpoint slot never written, an uninitialised output tail, bounds cached on a cu_seqlens
tensor's identity); each must be caught and localized.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from suite_paths import PLUGINS, rel_rms_agrees_with_the_suite

from kda_cases.case import Case
from kda_cases.dtypes import bits
from kda_cases.guards import memory_of
from kda_cases.materialize import materialize
from kda_conformance.checks import get_check, run_check
from kda_conformance.cli import main
from kda_conformance.repro.standalone import needs_source, suite_imports, where_it_runs_source
from kda_conformance.running.truth import case_truth
from kda_kernels import registry
from kda_kernels.serving import (
    NULL_SLOT,
    PAD_SLOT_ID,
    PAD_SLOT_IDS,
    POISON_MODES,
    check_slots,
    gather_run_scatter,
    outside,
    pad_slot_for,
    plan_pool,
    poison_like,
    poisoned_scratch,
    run_serving,
)

CPU = torch.device("cpu")
# Packed, a zero-length member, an initial state, a checkpoint: every slot kind and the padding at once.
CASE = Case(
    seq_lens=(20, 0, 13), packed=True, num_heads=1, num_v_heads=1, head_k_dim=32, head_v_dim=32, checkpoints=((0, 16),)
)


pytestmark = pytest.mark.usefixtures("planted_zoo")


def test_plan_keeps_slot_zero_free_and_names_each_slot_once() -> None:
    plan = plan_pool(CASE)
    named = [*plan.seq_slots, *plan.checkpoint_slots]
    assert NULL_SLOT not in named and len(set(named)) == len(named)
    assert NULL_SLOT in plan.unnamed_slots and len(plan.unnamed_slots) == plan.num_slots - len(named)
    assert plan.state_indices()[-plan.padding :] == (PAD_SLOT_ID,) * plan.padding
    assert plan.state_indices(NULL_SLOT)[-plan.padding :] == (NULL_SLOT,) * plan.padding
    assert plan.out_rows > CASE.total_tokens


@pytest.mark.parametrize(
    ("indices", "message"),
    [
        ([1, 1, -1], "name slot(s) [1] for more than one sequence"),
        ([0, 2, -1], "out of range"),
        ([1, 9, -1], "out of range"),
        ([1, 2, 3], "must be -1 or 0 (padding)"),
    ],
)
def test_bad_slot_indices_are_refused_with_the_argument_named(indices: list[int], message: str) -> None:
    with pytest.raises(ValueError, match="state_indices") as raised:
        check_slots(torch.tensor(indices), num_slots=5, num_seqs=2)
    assert message in str(raised.value)


def test_each_padding_sentinel_a_backend_declares_is_handed_to_its_paged_api() -> None:
    """vLLM pads state indices with 0 (its null block), SGLang with -1: a backend that declares both gets each
    on some cases, one that declares -1 only never gets 0, and the paged API sees the sentinel it was given."""
    seen: list[int] = []

    class Recording(registry.get("torch_chunk").__class__):
        def run_paged(self, batch, pool, state_indices, has_initial_state, out, checkpoint_slots) -> None:
            seen.extend(state_indices[batch.case.num_seqs :].tolist())
            gather_run_scatter(self, batch, pool, state_indices, has_initial_state, out, checkpoint_slots)

    both, minus_one = Recording(), Recording()
    minus_one.pad_slot_ids = (PAD_SLOT_ID,)
    case = CASE.replace(checkpoints=())
    assert {pad_slot_for(both, case.replace(seed=seed)) for seed in range(4)} == set(PAD_SLOT_IDS)
    assert {pad_slot_for(minus_one, case.replace(seed=seed)) for seed in range(4)} == {PAD_SLOT_ID}
    for seed in (0, 1):
        served = case.replace(seed=seed)
        run_serving(both, materialize(served, CPU), plan_pool(served))
    assert set(seen) == set(PAD_SLOT_IDS)
    minus_one.pad_slot_ids = (7,)
    with pytest.raises(ValueError, match=r"pad_slot_ids \(7,\); allowed: a non-empty tuple of -1, 0"):
        pad_slot_for(minus_one, case)


def test_duplicate_slots_are_refused_by_the_harness() -> None:
    inputs = materialize(CASE.replace(checkpoints=()), CPU)
    plan = plan_pool(CASE.replace(checkpoints=()))
    twice = type(plan)(plan.num_slots, (plan.seq_slots[0],) * 3, (), plan.padding, plan.out_rows)
    with pytest.raises(ValueError, match="more than one sequence"):
        run_serving(registry.get("torch_chunk"), inputs, twice)


def test_poison_modes() -> None:
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert poison_like(x, "nan").isnan().all() and poison_like(x, "inf").isinf().all()
    assert (poison_like(x, "inf") < 0).any() and (poison_like(x, "sentinel") > 1e29).all()
    assert torch.equal(poison_like(x, "garbage", 3).view(torch.int16), poison_like(x, "garbage", 3).view(torch.int16))
    assert poison_like(x, "tenant").isfinite().all() and poison_like(x, "tenant").abs().sum() > 0
    assert not poison_like(x, "none").any()
    with pytest.raises(ValueError, match="poison mode 'bogus' unknown; choose from " + ", ".join(POISON_MODES)):
        poison_like(x, "bogus")


def test_poisoned_scratch_fills_empty_with_nan_and_restores_the_flags() -> None:
    before = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
    with poisoned_scratch(CPU, "nan"):
        assert torch.empty(16).isnan().all()
    assert (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory) == before


def failures(check: str, case: Case, backend: str, poison: str = "nan") -> list[str]:
    """The messages of the failed findings of ``check`` (its poison mode where it takes one)."""
    params = {"poison": poison} if check == "poison" else {}
    findings = run_check(get_check(check), case, registry.get(backend), CPU, params)
    return [f.message() for f in findings if f.failed]


@pytest.mark.parametrize("poison", [m for m in POISON_MODES if m != "none"])
def test_the_correct_baseline_survives_every_poison(poison: str) -> None:
    assert failures("poison", CASE, "torch_chunk", poison) == []


@pytest.mark.parametrize("check", ["steps", "checkpoint", "cu_seqlens"])
def test_the_correct_baseline_passes_the_step_checks(check: str) -> None:
    assert failures(check, CASE.replace(initial_state="random"), "torch_chunk") == []


# planted bug -> (check, poison, what the findings must say)
LOCALIZED = {
    "planted_pool_fresh_reads_slot": ("poison", "tenant", "poison reached the result from: fresh"),
    "planted_padding_writes_slot0": ("poison", "nan", "the null slot 0 was written"),
    "planted_pad_wraps_to_last_slot": ("poison", "nan", "{last}"),
    "planted_checkpoint_slot_unwritten": ("poison", "nan", "(checkpoint 0) differs with nan poison"),
    "planted_uninitialised_output_tail": ("poison", "nan", "(past the last token, 33) was written"),
    "planted_cu_seqlens_identity_cache": ("cu_seqlens", "none", "in-place metadata contract broken"),
    "planted_out_from_storage_start": ("poison", "nan", "the caller's buffer was written outside the output slice"),
}


@pytest.mark.parametrize("backend", sorted(LOCALIZED))
def test_each_serving_bug_is_caught_and_localized(backend: str) -> None:
    check, poison, expected = LOCALIZED[backend]
    # Fresh sequences for the bug that reads their slots; resumed ones (nonzero states everywhere) otherwise.
    case = CASE if backend == "planted_pool_fresh_reads_slot" else CASE.replace(initial_state="random")
    findings = failures(check, case, backend, poison)
    plan, last = plan_pool(case), plan_pool(case).num_slots - 1
    # The last slot: a spare one shows as written, a sequence's as that sequence's wrong final state.
    owner = f"seq {plan.seq_slots.index(last)} head" if last in plan.seq_slots else f"slot {last}"
    expected = expected.format(last=owner)
    assert any(expected in f for f in findings), findings


def test_a_padded_pool_is_a_strided_view_its_gaps_poisoned_and_watched() -> None:
    """Padded pages as vLLM's hybrid allocator builds them: slot stride past one slot, each slot's plane dense,
    the gaps poison; a correct kernel passes through them, one that addresses slots densely is caught."""
    case = CASE.replace(initial_state="random", pool_layout="padded")
    plan = plan_pool(case)
    slot = case.num_v_heads * case.head_k_dim * case.head_v_dim
    assert plan.slot_padding >= 64 and plan_pool(case.replace(pool_layout="dense")).slot_padding == 0
    inputs = materialize(case, CPU)
    served = run_serving(registry.get("torch_chunk"), inputs, plan, "nan")
    assert served.pool.stride(0) == slot + plan.slot_padding and served.pool[0].is_contiguous()
    gaps = memory_of(served.pool)[outside(served.pool)]
    assert gaps.numel() == plan.num_slots * plan.slot_padding and bool(gaps.isnan().all())
    assert failures("poison", case, "torch_chunk", "nan") == []
    caught = failures("poison", case, "planted_pool_dense_addressing", "nan")
    assert any("the pool's padding between slots was written" in f for f in caught), caught


def test_the_output_slice_lies_inside_a_larger_buffer_whose_other_rows_are_watched() -> None:
    case = CASE.replace(initial_state="random")
    plan = plan_pool(case)
    served = run_serving(registry.get("torch_chunk"), materialize(case, CPU), plan, "nan")
    assert served.out.storage_offset() == plan.out_offset * case.num_v_heads * case.head_v_dim > 0
    others = memory_of(served.out)[outside(served.out)]
    assert others.numel() == (plan.out_offset + plan.out_after) * case.num_v_heads * case.head_v_dim
    assert torch.equal(bits(others), bits(served.out_memory_before[outside(served.out)]))


@pytest.mark.slow
def test_repro_command_localizes_and_writes_a_failing_standalone_test(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    test_file = tmp_path / "test_slot0.py"
    argv = ["repro", "--backend", "planted_padding_writes_slot0", "--device", "cpu", "--case", CASE.to_json()]
    assert main([*argv, "--write-test", str(test_file)]) == 1
    out = capsys.readouterr().out
    assert "the null slot 0 was written" in out and "sequence 0 (20 tokens) -> slot" in out
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import kda_planted_bugs, pytest, sys; sys.exit(pytest.main(['-q', sys.argv[1]]))",
            str(test_file),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(PLUGINS), "PATH": ""},
    )
    assert done.returncode == 1 and "slot 0 written" in done.stdout, done.stdout[-2000:]
    without_plugin = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(test_file)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": ""},
    )
    assert without_plugin.returncode == 0 and "1 skipped" in without_plugin.stdout, without_plugin.stdout[-2000:]
    assert "needs kda_planted_bugs (the module that registers planted_padding_writes_slot0)" in without_plugin.stdout


@pytest.mark.slow
def test_a_standalone_test_holds_every_limit_the_suite_judged_and_names_its_check(tmp_path: Path) -> None:
    """Max-abs and rel-RMS of the output, the final states and the checkpoint states, each the suite's own
    limit; named for the finding's check. A rel-RMS-only failure (1.24x its limit) once wrote a file that
    passed, named for its poison."""
    case = CASE.replace(initial_state="random", checkpoints=((0, 8), (2, 12)))
    test_file = tmp_path / "test_limits.py"
    argv = ["repro", "--backend", "torch_chunk", "--device", "cpu", "--check", "budget", "--case", case.to_json()]
    assert main([*argv, "--write-test", str(test_file)]) == 0
    text = test_file.read_text()
    assert f"def test_{case.id.replace('-', '_')}_torch_chunk_budget():" in text and "check budget" in text
    rel_rms_agrees_with_the_suite(text)
    data_path = test_file.with_suffix(".pt")
    data = torch.load(data_path, weights_only=True)
    truth = case_truth(case.replace(packed=True), torch.device("cpu"))
    assert data["limits"] == {
        name: {"max_abs": budget.max_abs.value, "rel_rms": budget.rel_rms.value}
        for name, budget in truth.budgets.items()
    }
    assert set(data["limits"]) == {"o", "final_state", "checkpoint_states"}

    def standalone() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
                              capture_output=True, text=True, cwd=tmp_path)  # fmt: skip

    assert standalone().returncode == 0, "the correct backend's file passes"
    for tensor, metric, words in (
        ("o", "rel_rms", "output: rel-RMS"),
        ("checkpoint_states", "max_abs", "checkpoint states: max-abs"),
    ):
        limits = {name: dict(limit) for name, limit in data["limits"].items()}
        limits[tensor][metric] = 1e-30  # below what the correct run measures: only this limit is passed
        torch.save({**data, "limits": limits}, data_path)
        done = standalone()
        assert done.returncode == 1 and words in done.stdout, (tensor, metric, done.stdout[-1500:])


class _Tampered:
    """What a tampered bundle could hold: an object whose unpickling runs code (here: touches a file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


@pytest.mark.slow
def test_a_tampered_repro_bundle_is_refused_not_run(tmp_path: Path) -> None:
    test_file = tmp_path / "test_bundle.py"
    argv = ["repro", "--backend", "torch_chunk", "--device", "cpu", "--case", CASE.to_json()]
    assert main([*argv, "--write-test", str(test_file)]) == 0
    pytest_file = "import pytest, sys; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', sys.argv[1]]))"

    def standalone() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", pytest_file, str(test_file)], capture_output=True, text=True,
                              cwd=tmp_path)  # fmt: skip

    assert standalone().returncode == 0, "the bundle as written passes"
    marker = tmp_path / "code-ran"
    data = torch.load(test_file.with_suffix(".pt"), weights_only=True)
    torch.save({**data, "case_json": _Tampered(marker)}, test_file.with_suffix(".pt"))
    done = standalone()
    assert done.returncode == 1 and "Weights only load failed" in done.stdout, done.stdout[-2000:]
    assert not marker.exists(), "loading the tampered bundle ran its code"


def test_repro_names_a_bad_case(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["repro", "--backend", "torch_chunk", "--device", "cpu", "--case", "kda-000000000000"])
    assert stopped.value.code == 2 and "case id kda-000000000000 is not in the corpus" in capsys.readouterr().err
    assert main(["repro", "--backend", "torch_chunk", "--device", "cpu", "--case", CASE.to_json()]) == 0


@pytest.mark.slow
def test_fla_standalone_test_needs_only_torch_and_fla(tmp_path: Path) -> None:
    """The file written for FLA's chunk kernel imports nothing of this suite and passes where FLA passes
    (here on the CPU, in Triton's interpreter, which the suite switches on before pytest runs the file)."""
    test_file = tmp_path / "test_fla.py"
    argv = ["repro", "--backend", "fla_chunk", "--device", "cpu", "--poison", "sentinel", "--case", CASE.to_json()]
    assert main([*argv, "--write-test", str(test_file)]) == 0
    assert "kda_" not in "".join(line for line in test_file.read_text().splitlines() if "import" in line)

    def standalone(prelude: str) -> subprocess.CompletedProcess:
        run = (
            f"{prelude}import pytest, sys; sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', sys.argv[1]]))"
        )
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.run([sys.executable, "-c", run, str(test_file)], capture_output=True, text=True,
                              cwd=tmp_path, env=env)  # fmt: skip

    done = standalone("from kda_kernels import triton_interpret; triton_interpret.enable(); ")
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-2000:]
    # Without a GPU or the interpreter it skips, saying why, instead of failing in Triton ("0 active drivers").
    done = standalone("")
    assert done.returncode == 0 and "1 skipped" in done.stdout and "TRITON_INTERPRET=1" in done.stdout, done.stdout
    # Without its library it skips.
    done = standalone("import os, sys; os.environ['TRITON_INTERPRET'] = '1'; sys.modules['fla'] = None; ")
    assert done.returncode == 0 and "needs fla-core (pip install fla-core" in done.stdout, done.stdout[-2000:]
    # Where its library is there but a module it imports is not, it names that module, not the library.
    done = standalone("import os, sys; os.environ['TRITON_INTERPRET'] = '1'; sys.modules['einops'] = None; ")
    assert done.returncode == 0 and "needs einops, which fla-core imports" in done.stdout, done.stdout[-2000:]


def test_a_standalone_test_written_on_a_gpu_skips_without_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    namespace = {"torch": torch, "pytest": pytest, "os": os}
    exec(where_it_runs_source(registry.get("fla_chunk"), torch.device("cuda")), namespace)
    needs = r"needs a GPU \(it was written on cuda, where the finding was measured\)"
    with pytest.raises(pytest.skip.Exception, match=needs):
        namespace["where_it_runs"]()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the caching allocator's prefill is CUDA's (no GPU here)")
def test_cuda_allocator_hands_out_poisoned_blocks() -> None:
    """Memory that does not come through torch.empty's fill (a kernel's own scratch) is poisoned too."""
    device = torch.device("cuda")
    with poisoned_scratch(device, "sentinel"):
        torch.utils.deterministic.fill_uninitialized_memory = False  # look at the allocator's blocks alone
        small, large = torch.empty(1024, device=device), torch.empty(2**22, device=device)
        assert (small == 1e30).all() and (large == 1e30).all()


def test_a_standalone_file_runs_a_library_from_the_source_tree_its_variable_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """AITER runs from a source tree (KDA_AITER_SRC), not an installed package: its findings' files skipped
    "needs AITER" on the H200 with the tree named. They skip only where neither is there."""
    aiter = registry.get("aiter_default")
    [library] = [lib for lib in aiter.libraries if lib.source_variable]
    namespace: dict = {}
    exec("import importlib, os, pytest" + needs_source(aiter), namespace)
    call = f"needs({library.module!r}, {library.source_variable!r})"
    assert call in suite_imports(aiter)
    monkeypatch.setenv(library.source_variable, "/a/tree")
    assert eval(call, namespace) is None
    monkeypatch.delenv(library.source_variable)
    with pytest.raises(pytest.skip.Exception, match=f"needs {library.name}"):
        eval(call, namespace)
