"""Standalone repro files for the servers' copies of the kernels (vLLM's, GLM-5.3-Flash's, SGLang's): the file
carries the suite's loader (kernels/server_stubs.py) and the layers' calls (kernels/server_layers.py) verbatim,
so its call is the backend's call, bit for bit, whether the server is installed or named by its source tree;
against the servers' test doubles (tests/doubles/)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from suite_paths import alone_in

from kda_cases.case import Case
from kda_cases.materialize import materialize
from kda_conformance.checks import offsets_past_2_31 as offsets
from kda_conformance.repro.standalone_finding import (
    _needs_source,
    embedded_source,
    imports_of_the_suite,
    write_standalone_finding,
)
from kda_conformance.repro.upstream import finding_file_name, upstream_findings, write_finding_test
from kda_kernels import guard, registry, vendored_trees
from kda_kernels.backends import vendored
from kda_reports.store import load_store

ROOT = Path(__file__).resolve().parent.parent
DOUBLES = ROOT / "tests" / "doubles"
BASE = dict(seq_lens=(70, 0, 30), packed=True, head_k_dim=32, head_v_dim=32, initial_state="random", seed=9)
SERVERS = [  # backend, its double's tree, the case (inside the backend's envelope)
    ("vllm_chunk", "vllm_tree", Case(**BASE, gate="softplus", lower_bound=None, safe_gate=False)),
    ("vllm_chunk", "vllm_tree", Case(**BASE, gate="log", lower_bound=None, safe_gate=False, state_layout="v_first")),
    ("vllm_chunk", "vllm033_tree", Case(**BASE, gate="lower_bound", lower_bound=-2.0)),
    ("vllm_chunk", "vllm_old_tree", Case(**BASE, gate="softplus", lower_bound=None, safe_gate=False)),
    ("vllm_glm5_chunk", "vllm_glm5_tree", Case(**BASE, gate="lower_bound", lower_bound=-2.0, l2norm_in_kernel=True)),
    ("sglang_chunk", "sglang_tree", Case(**BASE, gate="softplus", lower_bound=None, safe_gate=False)),
]


def _double():
    import kda_server_double

    return kda_server_double


@pytest.fixture(autouse=True)
def doubles(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.syspath_prepend(str(DOUBLES))
    _double().CALLS.clear()
    yield
    for tree in vendored_trees.TREES:
        vendored.forget(tree)


def _file_namespace(backend: object, case: Case) -> dict:
    """What a written file defines before its test: the case, the drawing code, the loader and the call."""
    from kda_conformance.repro.standalone_finding import case_spec_source

    source = "import importlib, os, sys\nfrom pathlib import Path\nfrom types import SimpleNamespace\nimport pytest\n"
    source += "import torch\n" + case_spec_source(case) + embedded_source() + _needs_source(backend)
    source += embedded_source(backend.standalone_modules) + backend.standalone_source(case)
    namespace: dict = {}
    exec(source, namespace)
    return namespace


@pytest.mark.parametrize(("name", "tree", "case"), SERVERS, ids=lambda x: x if isinstance(x, str) else x.gate)
def test_a_servers_standalone_call_is_the_backends_call_bit_for_bit(
    name: str, tree: str, case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = registry.get(name)
    monkeypatch.setenv(backend.tree.variable, str(DOUBLES / tree))
    assert backend.supports(case), backend.supports(case).reason
    inputs = materialize(case)
    suite = guard.run_backend_call(backend, inputs)
    assert guard.take_breaches() == []
    suites_call = _double().CALLS[-1]
    for loaded in vendored_trees.TREES:  # the file loads the tree itself, as its maintainer's process would
        vendored.forget(loaded)
    namespace = _file_namespace(backend, case)
    x = namespace["draw"](namespace["CASE"])
    kwargs = {"A_log": x["A_log"], "dt_bias": x["dt_bias"]}
    h0 = None if x["initial_state"] is None else x["initial_state"].float()
    o, final = namespace["call"](x["q"], x["k"], x["v"], x["g"], x["beta"], h0, x["cu_seqlens"], **kwargs)
    files_call = _double().CALLS[-1]
    assert files_call.keys() == suites_call.keys()
    for key, value in suites_call.items():
        same = torch.equal(value, files_call[key]) if isinstance(value, torch.Tensor) else value == files_call[key]
        assert same, key
    assert torch.equal(o, suite.o)
    assert torch.equal(final.to(suite.final_state.dtype), suite.final_state)


def test_a_servers_standalone_call_skips_naming_the_server_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = registry.get("vllm_chunk")
    monkeypatch.delenv(backend.tree.variable, raising=False)
    if any(name == "vllm" or name.startswith("vllm.") for name in sys.modules) or _installed("vllm"):
        pytest.skip("vLLM is importable here")
    namespace = _file_namespace(backend, Case(seq_lens=(9,), head_k_dim=16, head_v_dim=16))
    with pytest.raises(pytest.skip.Exception, match="needs vLLM"):
        namespace["call"](*(torch.zeros(1),) * 5, None, None, A_log=None, dt_bias=None)
    assert registry.get("vllm_kimi_chunk_amd").standalone_source is None  # ROCm only: vLLM's allocator not carried


def _installed(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


@pytest.mark.slow
def test_a_vllm_findings_file_fails_on_the_wrong_kernel_passes_on_the_right_one_and_stands_alone(
    tmp_path: Path,
) -> None:
    """From a failing run of the vLLM 0.33 double (its last token's output planted wrong; its tree named by
    KDA_VLLM_SRC) to a file run alone in an empty folder, importing nothing of the suite; then the same finding
    as the offsets check records it, behind a filler past which the double is wrong (as a wrapped offset makes
    it): its file packs the case behind that filler and fails there."""
    case = Case(seq_lens=(40, 25), packed=True, head_k_dim=16, head_v_dim=16, num_heads=2, num_v_heads=2, seed=4)
    paths = os.pathsep.join([str(DOUBLES), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": paths, "KDA_VLLM_SRC": str(DOUBLES / "vllm033_tree")}
    store = tmp_path / "store"
    cli = [sys.executable, "-c", "import sys; from kda_conformance.cli import main; sys.exit(main(sys.argv[1:]))"]
    run = [*cli, "run", "--device", "cpu", "--backend", "vllm_chunk", "--case", case.to_json(), "--out", str(store)]
    wrong = {_double().WRONG_PAST: "64"}  # the batch's last token
    done = subprocess.run([*run, "--no-dashboard"], env={**env, **wrong}, capture_output=True, text=True)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    [finding] = [f for f in upstream_findings(load_store(store).records, ()) if f.status == "new"]
    (tmp_path / "written").mkdir()
    path = write_standalone_finding(
        finding, case, registry.get("vllm_chunk"), tmp_path / "written", finding_file_name(finding.id, "vllm")
    )
    text = path.read_text()
    assert imports_of_the_suite(text) == []
    assert "# ---- kda-conformance kernels/server_stubs.py, verbatim" in text
    assert "# ---- kda-conformance kernels/server_layers.py, verbatim" in text
    alone = tmp_path / "alone"
    pytest_file = alone_in(alone, text, path.name)
    bare = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KDA_VLLM_SRC")}
    server = {**bare, "PYTHONPATH": str(DOUBLES), "KDA_VLLM_SRC": str(DOUBLES / "vllm033_tree")}
    fails = subprocess.run(pytest_file, cwd=alone, env={**server, **wrong}, capture_output=True, text=True)
    assert fails.returncode == 1 and "o: max_abs" in fails.stdout, fails.stdout[-3000:]
    assert "first at (row, token, head) (0, 64" in fails.stdout, fails.stdout[-3000:]  # the batch's last token
    fixed = subprocess.run(pytest_file, cwd=alone, env=server, capture_output=True, text=True)
    assert fixed.returncode == 0 and "1 passed" in fixed.stdout, fixed.stdout[-3000:]
    if not _installed("vllm"):
        skips = subprocess.run(pytest_file, cwd=alone, env=bare, capture_output=True, text=True)
        assert skips.returncode == 0 and "needs vLLM" in skips.stdout, skips.stdout[-3000:]
    # The offsets check's record of the same call behind 96 tokens of filler, the double wrong from row 100 on.
    subject = "behind 96 tokens of filler (past 2147483648 elements)"
    measured = tuple(dataclasses.replace(m, check=offsets.NAME, subject=subject) for m in finding.measured)
    behind = dataclasses.replace(finding, id="behind-filler", check=offsets.NAME, measured=measured)
    path = write_standalone_finding(behind, case, registry.get("vllm_chunk"), alone, "test_behind_filler_vllm.py")
    assert "FILLER = 96" in path.read_text() and imports_of_the_suite(path.read_text()) == []
    pytest_file[-1] = path.name
    fails = subprocess.run(pytest_file, cwd=alone, env={**server, _double().WRONG_PAST: "100"}, capture_output=True,
                           text=True)  # fmt: skip
    assert fails.returncode == 1 and "first at (row, token, head) (0, 4," in fails.stdout, fails.stdout[-3000:]
    # Wrong only past the case's rows (in the filler's place before them, nothing the file judges): it passes.
    past = subprocess.run(pytest_file, cwd=alone, env={**server, _double().WRONG_PAST: "161"}, capture_output=True,
                          text=True)  # fmt: skip
    assert past.returncode == 0 and "1 passed" in past.stdout, past.stdout[-3000:]


def test_one_cause_in_two_servers_copies_gives_each_server_its_own_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finding measured on vLLM's copy and SGLang's (one ledger entry, one cause) is written as one file per
    library, each named for it and calling that library's kernel: each maintainer runs their own."""
    trees = {"KDA_VLLM_SRC": str(DOUBLES / "vllm_tree"), "KDA_SGLANG_SRC": str(DOUBLES / "sglang_tree")}
    for variable, tree in trees.items():
        monkeypatch.setenv(variable, tree)
    case = Case(seq_lens=(40, 25), packed=True, head_k_dim=16, head_v_dim=16, seed=4, gate="softplus",
                lower_bound=None, safe_gate=False)  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(DOUBLES), os.environ.get("PYTHONPATH", "")])}
    cli = [sys.executable, "-c", "import sys; from kda_conformance.cli import main; sys.exit(main(sys.argv[1:]))"]
    run = [*cli, "run", "--device", "cpu", "--backend", "vllm_chunk", "--backend", "sglang_chunk", "--no-dashboard"]
    done = subprocess.run([*run, "--case", case.to_json(), "--out", str(tmp_path / "store")],
                          env={**env, _double().WRONG_PAST: "64"}, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    [finding] = [f for f in upstream_findings(load_store(tmp_path / "store").records, ()) if f.status == "new"]
    assert set(finding.backends.split(", ")) == {"vllm_chunk", "sglang_chunk"}, finding.backends
    written = tmp_path / "written"
    written.mkdir()
    for name in ("vllm_chunk", "sglang_chunk"):  # the doubles are plain torch, not Triton in its interpreter
        monkeypatch.setattr(type(registry.get(name)), "interpreted", lambda self, device: False)
    said = write_finding_test(finding, torch.device("cpu"), written)
    names = {path.name for path in written.glob("test_*.py")}
    assert names == {finding_file_name(finding.id, "vllm"), finding_file_name(finding.id, "sglang")}, said.test
    for path in written.glob("test_*.py"):
        text = path.read_text()
        assert imports_of_the_suite(text) == [] and f"pytest {path.name}" in text
        assert path.name in said.test
    assert "needs torch, pytest and SGLang" in (written / finding_file_name(finding.id, "sglang")).read_text()
    assert "needs torch, pytest and vLLM" in (written / finding_file_name(finding.id, "vllm")).read_text()
