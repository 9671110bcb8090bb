"""vLLM's and SGLang's vendored KDA kernels, loaded from a source tree (kernels/vendored_trees.py; the backends:
kernels/backends/vendored.py), against test doubles
of each API (tests/doubles/): signature detection, the argument mapping and the state handling each server's
layer does, the layout probe, and the reasons given when a tree is missing or needs what the loader lacks."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kda_cases.case import Case
from kda_cases.materialize import materialize
from kda_conformance.cli import main
from kda_kernels import guard, registry, server_stubs, vendored_trees
from kda_kernels.backends import vendored
from kda_kernels.protocol import Unsupported
from kda_kernels.vendored_trees import SGLANG, VLLM
from kda_reports.runfile import read_run

DOUBLES = Path(__file__).with_name("doubles")
NO_BOUND = {"lower_bound": None, "safe_gate": False}
CASES = (
    # packed, a zero-length member, a random initial state (K-first in the case, V-first in the pool)
    Case(seq_lens=(70, 0, 30), packed=True, head_k_dim=32, head_v_dim=32, gate="softplus", initial_state="random",
         **NO_BOUND),
    Case(seq_lens=(40,), num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=32, gate="log", **NO_BOUND),
    Case(seq_lens=(65,), head_k_dim=32, head_v_dim=32, gate="softplus", initial_state="random",
         state_layout="v_first", beta_sigmoid_in_kernel=False, **NO_BOUND),
)  # fmt: skip


@pytest.fixture(autouse=True)
def doubles(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.syspath_prepend(str(DOUBLES))
    import kda_server_double

    kda_server_double.CALLS.clear()
    yield
    for tree in vendored_trees.TREES:
        vendored.forget(tree)


def _calls() -> list[dict]:
    import kda_server_double

    return kda_server_double.CALLS


def _run(backend: str, case: Case, out: Path) -> int:
    argv = ["run", "--backend", backend, "--device", "cpu", "--case", case.to_json(), "--out", str(out)]
    return main([*argv, "--no-dashboard"])


def test_vllm_current_tree_is_called_as_its_layer_calls_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VLLM.variable, str(DOUBLES / "vllm_tree"))
    for n, case in enumerate(CASES):
        assert _run("vllm_chunk", case, tmp_path / f"out{n}") == 0, case.label
    fused = [c for c in _calls() if c["entry"] == "chunk_kda_with_fused_gate"]
    assert fused and all(c["A_log"] == (1, 1, c["initial_state"].shape[1], 1) for c in fused)  # vLLM's shape
    assert any(c["entry"] == "chunk_kda" for c in _calls())  # the precomputed (log) gate
    packed = next(c for c in _calls() if c["cu_seqlens"] is not None)
    assert packed["cu_seqlens"].tolist() == [0, 70, 70, 100]
    fresh = next(c for c in _calls() if c["initial_state"].shape[-2:] == (32, 16) and c["beta"].shape[1] == 40)
    assert not fresh["initial_state"].any(), "a fresh sequence's slot is zeroed, then gathered: zeros"
    assert not vendored_trees.load(VLLM).__name__.startswith("vllm.model_executor")  # the newest layout first
    records = read_run(next((tmp_path / "out0" / "runs").glob("*.parquet")))
    assert json.loads(records["env_source_trees"].iloc[0]) == {"KDA_VLLM_SRC": "a vLLM test double"}


def test_vllm_older_tree_gates_before_the_call_and_keeps_states_k_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(VLLM.variable, str(DOUBLES / "vllm_old_tree"))
    assert not registry.get("vllm_chunk").kernel_v_first(__import__("torch").device("cpu"))
    for n, case in enumerate(CASES[:2]):
        assert _run("vllm_chunk", case, tmp_path / f"out{n}") == 0, case.label
    assert {c["entry"] for c in _calls()} == {"chunk_kda"}


def test_vllm_033_layout_takes_raw_beta_and_the_lower_bound_gate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(VLLM.variable, str(DOUBLES / "vllm033_tree"))
    lower_bound = Case(seq_lens=(50, 20), packed=True, head_k_dim=32, head_v_dim=32, initial_state="random")
    for n, case in enumerate((lower_bound, *CASES[:2])):
        assert _run("vllm_chunk", case, tmp_path / f"out{n}") == 0, case.label
    fused = [c for c in _calls() if c["entry"] == "chunk_kda_with_fused_gate"]
    assert [c["lower_bound"] for c in fused] == [-5.0, None] and all(c["A_log"] == (2,) for c in fused)
    assert bool((fused[0]["raw_beta"] < 0).any()), "beta goes in raw: its sigmoid is the kernel's"
    assert vendored_trees.load(VLLM).__name__ == "vllm.models.kimi_k3.nvidia.ops.third_party.kda"
    backend = registry.get("vllm_chunk")
    activated = Case(seq_lens=(9,), gate="softplus", beta_sigmoid_in_kernel=False, **NO_BOUND)
    assert "takes beta raw" in backend.supports(activated).reason


def test_vllm_without_a_lower_bound_argument_has_no_lower_bound_gate_nor_gva(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VLLM.variable, str(DOUBLES / "vllm_tree"))
    backend = registry.get("vllm_chunk")
    assert "no lower-bound gate" in backend.supports(Case(seq_lens=(9,))).reason
    assert "no GVA" in backend.supports(Case(seq_lens=(9,), gate="softplus", num_v_heads=4, **NO_BOUND)).reason


def test_sglang_pool_api_reads_and_writes_each_sequence_slot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SGLANG.variable, str(DOUBLES / "sglang_tree"))
    lower_bound = Case(seq_lens=(50, 20), packed=True, num_heads=2, num_v_heads=2, head_k_dim=32, head_v_dim=32,
                       initial_state="random")  # fmt: skip
    for n, case in enumerate((*CASES, lower_bound)):
        assert _run("sglang_chunk", case, tmp_path / f"out{n}") == 0, case.label
    calls = _calls()
    assert all(c["indices"].tolist() == list(range(1, len(c["indices"]) + 1)) for c in calls)  # slot 0: the null block
    assert all(not c["pool"][0].any() for c in calls)
    assert any(c["pool"][1:].any() for c in calls)  # resumed sequences' states were in their slots
    # beta goes in raw with beta_is_raw=True where the case applies the sigmoid in the kernel, activated otherwise
    assert [c["beta_is_raw"] for c in calls] == [True, True, False, True]


@pytest.mark.parametrize("tree", [VLLM, SGLANG], ids=lambda t: t.package)
def test_a_missing_or_incomplete_tree_says_why(
    tree: vendored_trees.Tree, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"{tree.package}_chunk"
    monkeypatch.delenv(tree.variable, raising=False)
    assert (
        f"{tree.variable} names no {tree.server} source tree"
        in registry.get(name).availability(torch.device("cpu")).reason
    )
    monkeypatch.setenv(tree.variable, str(tmp_path))
    assert f"holds no {tree.package}/ folder" in registry.get(name).availability(torch.device("cpu")).reason
    kda = tmp_path.joinpath(*tree.modules[-1].split(".")).with_suffix(".py")
    kda.parent.mkdir(parents=True)
    kda.write_text(f"from {tree.package}.distributed import parallel_state\n")
    reason = registry.get(name).availability(torch.device("cpu")).reason
    assert f"importing {tree.server}'s {tree.modules[-1]} failed" in reason and "distributed" in reason, reason
    # Kernels written with block pointers, which the pinned Triton's CPU interpreter refuses (SGLang 0.5.23's)
    vendored.forget(tree)
    kda.write_text("import triton.language as tl\n\n\ndef chunk_kda(q):\n    return tl.make_block_ptr\n")
    reason = registry.get(name).availability(torch.device("cpu")).reason
    assert "kernels use tl.make_block_ptr (kda), which Triton's CPU interpreter" in reason, reason
    # Kernels the interpreter fails on (vLLM 0.33's: a module-level alias of a Triton function): this
    # machine's limit, said as such, not an error charged to the kernel
    vendored.forget(tree)
    kda.write_text(
        "from triton.runtime.errors import InterpreterError\n\n\n"
        "def chunk_kda(*args, **kwargs):\n"
        "    raise InterpreterError(\"ValueError('Did you forget to add @triton.jit ?')\")\n"
    )
    reason = registry.get(name).availability(torch.device("cpu")).reason
    assert "Triton's CPU interpreter (triton==3.9.0) cannot run" in reason and "Did you forget" in reason, reason


def test_glm5_flash_is_called_as_its_layer_calls_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33's GLM-5.3-Flash copies (NVIDIA's and AMD's): beta activated in fp32 before the call, A_log as
    the layer's [1, 1, H, 1] parameter, the safe gate always on with the case's bound, q/k normalised in the
    kernel, V-first states (zeros for a fresh sequence); a packed batch with an initial state."""
    monkeypatch.setenv(VLLM.variable, str(DOUBLES / "vllm_glm5_tree"))
    case = Case(seq_lens=(50, 0, 20), packed=True, head_k_dim=32, head_v_dim=32, initial_state="random",
                lower_bound=-1.0)  # fmt: skip
    fresh = Case(seq_lens=(40,), head_k_dim=32, head_v_dim=32, beta_sigmoid_in_kernel=False)
    for name in ("vllm_glm5_chunk", "vllm_glm5_chunk_amd"):
        for n, chosen in enumerate((case, fresh)):
            assert _run(name, chosen, tmp_path / f"{name}{n}") == 0, (name, chosen.label)
    calls = [
        c for c in _calls() if c["entry"] == "glm5_chunk_kda_with_fused_gate" and c["initial_state"].shape[-1] == 32
    ]
    assert calls and all(c["A_log"] == (1, 1, 2, 1) and c["safe_gate"] and c["l2norm"] for c in calls)
    assert {c["lower_bound"] for c in calls} == {-1.0, -5.0}
    assert all(c["beta"].dtype == torch.float32 for c in calls)
    assert any(not c["initial_state"].any() for c in calls), "a fresh sequence passes zeros"
    assert vendored_trees.load(vendored_trees.VLLM_GLM5).__name__.endswith(
        "glm5next.nvidia.ops.third_party.kda.kernels"
    )
    # The layer's envelope: the safe lower-bound gate only, q/k normalised in the kernel, K = V, no GVA.
    backend = registry.get("vllm_glm5_chunk")
    assert "gates lower_bound" in backend.supports(Case(seq_lens=(9,), gate="softplus", **NO_BOUND)).reason
    assert "l2norm_in_kernel True" in backend.supports(Case(seq_lens=(9,), l2norm_in_kernel=False)).reason


def test_a_tree_without_the_entry_point_is_unavailable_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pointed at a tree that holds only GLM-5.3-Flash's copy, Kimi's backend is unavailable with what the
    tree lacks (on the H200 it raised AttributeError and was charged to the kernel); GLM-5.3-Flash's is
    unavailable at a Kimi-only tree the same way."""
    cpu = torch.device("cpu")
    monkeypatch.setenv(VLLM.variable, str(DOUBLES / "vllm_glm5_tree"))
    reason = registry.get("vllm_chunk").availability(cpu).reason
    assert "holds none of vllm.models.kimi_k3" in reason, reason
    monkeypatch.setenv(VLLM.variable, str(DOUBLES / "vllm033_tree"))
    reason = registry.get("vllm_glm5_chunk").availability(cpu).reason
    assert "holds none of vllm.models.glm5next.nvidia.ops.third_party.kda.kernels" in reason, reason
    for tree in vendored_trees.TREES:
        vendored.forget(tree)
    # A module that is there but has neither entry point: unavailable, naming both
    kda = tmp_path.joinpath(*VLLM.modules[0].split("."), "__init__.py")
    kda.parent.mkdir(parents=True)
    kda.write_text("def fused_recurrent_kda(*args, **kwargs):\n    raise AssertionError\n")
    monkeypatch.setenv(VLLM.variable, str(tmp_path))
    reason = registry.get("vllm_chunk").availability(cpu).reason
    assert "has no chunk_kda_with_fused_gate nor chunk_kda" in reason, reason


def test_a_stub_the_kernels_need_and_the_loader_lacks_is_the_suites_gap_not_the_kernels() -> None:
    """What the kernels ask of a stub that the loader does not provide is a StubGap: an AttributeError to
    `hasattr` and `from m import x`, and an Unsupported to the checks (a skip naming it, not an error)."""
    platform = server_stubs._Platform()
    assert not hasattr(platform, "some_new_question")
    with pytest.raises(server_stubs.StubGap, match="current_platform has no some_new_question"):
        platform.some_new_question()
    with pytest.raises(vendored_trees.StubGap, match="current_platform has no some_new_question") as raised:
        with vendored_trees.stub_gaps():  # how the backends call the kernels
            platform.some_new_question()
    assert isinstance(raised.value, Unsupported)
    assert platform.has_device_capability(80) is torch.cuda.is_available()
    stub = server_stubs._Stub("vllm.utils.math_utils")
    with pytest.raises(server_stubs.StubGap, match=r"stub of vllm\.utils\.math_utils has no round_up"):
        stub.round_up  # noqa: B018


def test_kimi_k3s_output_goes_into_the_slice_of_the_layers_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kimi K3's layer passes out=core_attn_out[:, non_spec_slice]: the adapter hands the kernel such a slice
    (an offset view of a NaN buffer), reads the buffer as the layer does, and a kernel writing the rows around
    the slice (other tokens' output) breaks its call."""
    monkeypatch.setenv(VLLM.variable, str(DOUBLES / "vllm033_tree"))
    case = Case(seq_lens=(50, 20), packed=True, head_k_dim=32, head_v_dim=32, initial_state="random")
    assert _run("vllm_chunk", case, tmp_path / "right") == 0
    outs = [c["out"] for c in _calls() if c["entry"] == "chunk_kda_with_fused_gate"]
    assert outs and all(o is not None and o.storage_offset() > 0 for o in outs), [
        o is None or o.storage_offset() for o in outs
    ]
    # A batch of rows gets one contiguous slice too: the layer passes no strided out= (on the H200, vLLM's
    # kernel wrote around a strided one, 3 batched cases of 2026-12-02).
    batched = Case(seq_lens=(24, 24), head_k_dim=32, head_v_dim=32, initial_state="random")
    assert _run("vllm_chunk", batched, tmp_path / "batched") == 0
    outs = [c["out"] for c in _calls() if c["entry"] == "chunk_kda_with_fused_gate" and c["out"].shape[0] == 2]
    assert outs and all(o.is_contiguous() and o.storage_offset() > 0 for o in outs)
    module = vendored_trees.load(VLLM)
    right = module.chunk_kda_with_fused_gate

    @functools.wraps(right)  # its signature: what the adapter reads the API from
    def spills(*args, out=None, **kwargs):
        o, final = right(*args, out=out, **kwargs)
        past = out.as_strided((out.shape[0], out.shape[1] + 1, *out.shape[2:]), out.stride(), out.storage_offset())
        past[:, -1] = 0  # the row after its slice: another token's
        return o, final

    backend = registry.get("vllm_chunk")
    # The buffer's check is the suite's work inside the call: listeners (the sync count) hear it as such.
    heard: list[str] = []

    def listen(event: str, called: object) -> None:
        heard.append(event)

    guard.add_listener(listen)
    try:
        result = guard.run_backend_call(backend, materialize(case, torch.device("cpu")))
    finally:
        guard.remove_listener(listen)
    assert heard == ["call", "suite", "kernel", "returned"] and result.o_in_caller_buffer
    monkeypatch.setattr(module, "chunk_kda_with_fused_gate", spills)
    with pytest.raises(RuntimeError, match="1 rows of the layer's output buffer outside the out= slice"):
        backend.run(materialize(case, torch.device("cpu")))


def test_sglang_graph_prefill_tables_built_on_the_host_as_sglang_builds_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang 0.5.23's CUDA-graph prefill passes chunk_indices / chunk_offsets it builds on the host, padded
    to the bucket's bound with rows past every sequence: the host-metadata check holds the result bitwise
    to the derived one (the double checks the tables row by row), a zero-length member included."""
    monkeypatch.setenv(SGLANG.variable, str(DOUBLES / "sglang_tree"))
    backend = registry.get("sglang_chunk")
    assert backend.envelope.host_metadata == ("chunk_indices", "chunk_offsets")
    tables = backend.host_metadata(torch.device("cpu"), torch.tensor([0, 130, 130, 147]))
    # cdiv(147, 64) + 3 sequences = 6 rows, 4 of them real
    assert tables["chunk_indices"].tolist() == [[0, 0], [0, 1], [0, 2], [2, 0], [0, 1 << 20], [0, 1 << 20]]
    assert tables["chunk_offsets"].tolist() == [0, 3, 3, 4] and tables["chunk_offsets"].dtype == torch.int32
    assert tables["chunk_indices"].untyped_storage().data_ptr() == tables["chunk_offsets"].untyped_storage().data_ptr()
    case = Case(seq_lens=(130, 0, 17), packed=True, head_k_dim=32, head_v_dim=32, initial_state="random")
    argv = ["repro", "--backend", "sglang_chunk", "--device", "cpu", "--check", "host_metadata"]
    assert main([*argv, "--case", case.to_json(), "--out", str(tmp_path)]) == 0
    passed = [c for c in _calls() if c["chunk_indices"] is not None]
    assert passed and all(c["chunk_indices"].shape[0] > int(c["chunk_offsets"][-1]) for c in passed)


def test_the_layout_probe_skips_only_a_shape_it_cannot_read_not_a_kernels_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel that fails both probe calls (a fault on the device, say) raises its own error, charged to it;
    only a final state of neither layout is the suite's gap (Unsupported)."""
    monkeypatch.setenv(VLLM.variable, str(DOUBLES / "vllm_tree"))
    backend = registry.get("vllm_chunk")

    def faulting(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(backend, "prefill", faulting)
    with pytest.raises(RuntimeError, match="illegal memory access") as raised:
        vendored._probe_layout(backend, "cpu")
    assert not isinstance(raised.value, Unsupported)
    monkeypatch.setattr(backend, "prefill", lambda kda, x, options, v_first: (x.v, torch.zeros(1, 1, 5, 5)))
    with pytest.raises(Unsupported, match=r"final state has shape \(1, 1, 5, 5\)"):
        vendored._probe_layout(backend, "cpu")
