"""Repros that stand alone (conformance/repro/standalone_finding.py): a finding's pytest file needs torch, the
kernel's own package and pytest, and nothing of this suite; it draws the suite's very inputs from the seed,
computes the float64 truth with a plain token loop, fails while the kernel is wrong and skips naming the package
where it is missing. ``findings --report ID`` prints the upstream issue's text."""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from suite_paths import alone_in, rel_rms_agrees_with_the_suite

from kda_cases.case import Case
from kda_cases.materialize import materialize
from kda_conformance.repro.standalone_finding import case_spec_source, embedded_source, imports_of_the_suite
from kda_conformance.repro.upstream import upstream_findings, write_finding_test
from kda_reference.plain import kda_token_loop
from kda_reference.run import run_reference
from kda_reports.store import load_store

ROOT = Path(__file__).resolve().parent.parent
PLUGINS, DOUBLES = ROOT / "tests" / "plugins", ROOT / "tests" / "doubles"
CASES = (
    Case(seq_lens=(37, 0, 65), packed=True, key_regime="correlated", key_rho=0.9, initial_state="large",
         state_layout="v_first", input_scale="outliers", input_layout="fused", gate="softplus", safe_gate=False,
         lower_bound=None, gate_regime="reset", dtype="fp16", num_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=32),
    Case(seq_lens=(40, 40), key_regime="repeated", input_scale="large", gate="log", gate_regime="weak",
         beta_sigmoid_in_kernel=False, l2norm_in_kernel=False, input_layout="head_major", scale=0.3, head_k_dim=16,
         head_v_dim=16, initial_state="random", state_dtype="bf16"),
    Case(seq_lens=(33,), head_k_dim=16, head_v_dim=16, beta_regime="near_one", gate_regime="strong"),
)  # fmt: skip


def embedded(case: Case) -> dict:
    namespace: dict = {}
    exec("from types import SimpleNamespace\n" + case_spec_source(case) + embedded_source(), namespace)
    return namespace


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_the_file_draws_the_suites_inputs_bit_for_bit(case: Case) -> None:
    namespace = embedded(case)
    drawn = namespace["draw"](namespace["CASE"])
    suite = materialize(case)
    for name, value in drawn.items():
        want = getattr(suite, name)
        assert (value is None and want is None) or torch.equal(value, want), name
    laid = namespace["laid_out"](case.input_layout, *(drawn[n] for n in ("q", "k", "v", "g", "beta")))
    assert [x.stride() for x in laid] == [getattr(suite, n).stride() for n in ("q", "k", "v", "g", "beta")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_the_files_plain_token_loop_is_the_definition(case: Case) -> None:
    inputs = materialize(case)
    truth = run_reference(inputs, "loop")
    kwargs = {k: v for k, v in inputs.kernel_kwargs().items() if k not in ("initial_state", "cu_seqlens")}
    o, final = kda_token_loop(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, initial_state=inputs.initial_state,
                              cu_seqlens=inputs.cu_seqlens, **kwargs)  # fmt: skip
    assert (o - truth.o).abs().max() <= 1e-12 * max(1.0, float(truth.o.abs().max()))
    assert (final - truth.final_state).abs().max() <= 1e-12 * max(1.0, float(truth.final_state.abs().max()))


def test_suite_imports_are_found_however_written() -> None:
    source = 'import kda_kernels\nfrom kda_cases.case import Case\nneeds("kda_reference.x")\nimport torch\nneeds("fla")'
    assert imports_of_the_suite(source) == ["kda_kernels", "kda_cases.case", "kda_reference.x"]


@pytest.mark.slow
def test_a_written_file_imports_nothing_of_the_suite_fails_and_skips_without_its_package(tmp_path: Path) -> None:
    path = os.pathsep.join([str(PLUGINS), str(DOUBLES), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    case = Case(seq_lens=(20, 0, 17), packed=True, initial_state="random", num_heads=1, num_v_heads=2, head_k_dim=16,
                head_v_dim=16)  # fmt: skip
    store, written = tmp_path / "store", tmp_path / "findings"
    cli = [sys.executable, "-c", "import sys; from kda_conformance.cli import main; sys.exit(main(sys.argv[1:]))"]
    run = [*cli, "run", "--device", "cpu", "--plugin", "kda_fake_library", "--backend", "fake_kda_chunk"]
    done = subprocess.run([*run, "--case", case.to_json(), "--out", str(store), "--no-dashboard"], env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    findings = [*cli, "findings", "--store", str(store), "--plugin", "kda_fake_library", "--device", "cpu"]
    done = subprocess.run([*findings, "--write-tests", str(written)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    [file] = written.glob("test_*.py")
    assert file.name.endswith("_fake_kda.py"), file.name  # named for the library whose kernel it calls
    assert "fails today on cpu; the suite's budget check fails here" in done.stdout, done.stdout
    assert imports_of_the_suite(file.read_text()) == [] and not list(written.glob("*.pt"))
    # A fresh folder, only the file: torch, pytest and the library's package are all it needs.
    alone = tmp_path / "alone"
    pytest_file = alone_in(alone, file.read_text(), file.name)
    bare = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    fails = subprocess.run(pytest_file, cwd=alone, env={**bare, "PYTHONPATH": str(DOUBLES)}, capture_output=True,
                           text=True)  # fmt: skip
    assert (
        fails.returncode == 1 and "o: max_abs" in fails.stdout and "first at (row, token, head) (0, 20" in fails.stdout
    )
    assert "the library's own tolerance 0.005" in fails.stdout, fails.stdout[-3000:]
    fixed = subprocess.run(pytest_file, cwd=alone, env={**bare, "PYTHONPATH": str(DOUBLES), "FAKE_KDA_FIXED": "1"},
                           capture_output=True, text=True)  # fmt: skip
    assert fixed.returncode == 0 and "1 passed" in fixed.stdout, fixed.stdout[-3000:]  # passes once it is right
    skips = subprocess.run(pytest_file, cwd=alone, env=bare, capture_output=True, text=True)
    assert skips.returncode == 0 and "needs fake-kda (the suite's tests/doubles/fake_kda" in skips.stdout, skips.stdout
    text = file.read_text()
    rel_rms_agrees_with_the_suite(text)
    for said in ("What goes wrong:", "Measured with kda-conformance", "LIMITS = {", "LIBRARY_TOLERANCE = {'o': 0.005",
                 "MEASURED = {", "# o: max-abs limit", "Case (kda-conformance --case):"):  # fmt: skip
        assert said in text, said

    report = subprocess.run([*findings, "--report", file.read_text().removeprefix('"""').split(":")[0]], env=env,
                            capture_output=True, text=True)  # fmt: skip
    assert report.returncode == 0, report.stdout + report.stderr
    headings = ("# fake-kda loop: past the limit", "## What goes wrong", "## Environment", "## Repro",
                "## Expected and actual", "## Suspected cause", "## Related upstream issues and fixes")  # fmt: skip
    for heading in headings:
        assert heading in report.stdout, heading
    assert (
        "| fake_kda_chunk | budget | o |" in report.stdout
        and "| fake_kda_chunk | budget | final_state |" in report.stdout
    )
    # Each row says how many times its limits it is, the worst first: the failing rows past 1.
    rows = [line.split(" | ") for line in report.stdout.splitlines() if line.startswith("| fake_kda_chunk |")]
    times = [float(row[7]) for row in rows]
    assert times == sorted(times, reverse=True) and times[0] > 1, rows
    unknown = subprocess.run([*findings, "--report", "no-such-finding"], env=env, capture_output=True, text=True)
    assert unknown.returncode == 2 and "no such finding" in unknown.stdout
    # A GPU's records read on a CPU: the file is written and not run here, where it could only skip.
    [part] = (store / "runs").glob("*.parquet")
    pd.read_parquet(part).assign(env_device_type="cuda", env_device_name="NVIDIA H100 80GB HBM3").to_parquet(part)
    done = subprocess.run([*findings, "--write-tests", str(tmp_path / "gpu")], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and list((tmp_path / "gpu").glob("test_*.py")), done.stdout[-2000:]
    assert "(written; not run on cpu: it was measured on cuda NVIDIA H100 80GB HBM3" in " ".join(done.stdout.split())


def test_no_file_in_findings_imports_the_suite() -> None:
    files = sorted((ROOT / "findings").glob("*.py"))
    for file in files:
        assert imports_of_the_suite(file.read_text()) == [], file.name
    assert not list((ROOT / "findings").glob("*.pt")), "every input is drawn from its seed: no data files"


@pytest.mark.parametrize("layout", ["k_first", "v_first"])
def test_flashkdas_standalone_call_hands_it_what_its_readme_says(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """flash_kda.fwd as the repro file calls it (its test double on the CPU): V-first fp32 states, dt_bias [H, K],
    the scale, int64 cu_seqlens; the result is the float64 truth's to bf16 precision in either state layout."""
    from kda_kernels import registry

    monkeypatch.syspath_prepend(str(DOUBLES))
    case = Case(seq_lens=(20, 33), packed=True, initial_state="random", state_layout=layout, num_heads=2,
                num_v_heads=2, head_k_dim=128, head_v_dim=128, seed=3)  # fmt: skip
    namespace = embedded(case)
    source = registry.get("flashkda_cuda").standalone_source(case)
    exec("import importlib, os, sys\nneeds = lambda module: importlib.import_module(module)\n" + source, namespace)
    x = namespace["draw"](namespace["CASE"])
    inputs = materialize(case)
    kwargs = {k: v for k, v in inputs.kernel_kwargs().items() if k not in ("initial_state", "cu_seqlens")}
    o, final = namespace["call"](x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], x["cu_seqlens"],
                                 **kwargs)  # fmt: skip
    want_o, want_final = kda_token_loop(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                        cu_seqlens=x["cu_seqlens"], **kwargs)  # fmt: skip
    for got, want in ((o, want_o), (final, want_final)):
        assert got.shape == want.shape
        assert float((got.double() - want).norm() / want.norm()) < 1e-2


def test_a_finding_measured_non_finite_gets_a_file_that_imports() -> None:
    """AITER's FlashKDA on a zero-length member (an H100, 2026-12-06) measured inf: the written file said
    ``inf``, a name it does not define, and pytest could not import it (exit 2)."""
    import math

    from kda_conformance.repro.standalone_finding import _JUDGING, _literal

    seen = {"o": {"max_abs": math.inf, "rel_rms": math.nan, "nonfinite": 3}, "final_state": (-math.inf,)}
    limits = {"o": {"max_abs": 1e-3, "rel_rms": 2e-3}}
    text = _JUDGING.format(limits_comment="", limits=_literal(limits), library=_literal({}), seen=_literal(seen),
                           where="here")  # fmt: skip
    namespace: dict = {"torch": torch, "math": math}
    exec(text, namespace)
    measured = namespace["MEASURED"]
    assert measured["o"]["max_abs"] == math.inf and math.isnan(measured["o"]["rel_rms"])
    assert measured["final_state"] == (-math.inf,) and namespace["LIMITS"] == limits


def with_call(backend: object, case: Case) -> dict:
    """A file's drawing code and token loop, and the backend's ``call`` with the ``needs`` it imports through."""
    from kda_conformance.repro.standalone_finding import _needs_source

    namespace = embedded(case)
    exec("import importlib, os, sys\nimport pytest\n" + _needs_source(backend) + backend.standalone_source(case),
         namespace)  # fmt: skip
    return namespace


@pytest.fixture
def aiter_tree(monkeypatch: pytest.MonkeyPatch):
    """AITER's source checkout as its test double (tests/doubles/aiter_tree), named by KDA_AITER_SRC; the bare
    packages a call registers, and the tree on the path, are gone afterwards."""
    monkeypatch.setenv("KDA_AITER_SRC", str(DOUBLES / "aiter_tree"))
    monkeypatch.delenv("CHUNK_DELTA_ATTN_FLASH_KDA_SEG", raising=False)
    before, path = set(sys.modules), list(sys.path)
    yield
    sys.path[:] = path  # the call puts the tree on the path
    for name in set(sys.modules) - before:
        if name == "aiter" or name.startswith("aiter."):
            del sys.modules[name]


@pytest.mark.parametrize(
    ("backend", "flash_kda", "segment", "extra"),
    [("aiter_flashkda", True, None, None), ("aiter_flashkda_seg16", True, "16", None),
     ("aiter_flashkda_unsegmented", True, "0", None), ("aiter_default", False, None, None),
     ("aiter_native", True, None, "native")],
)  # fmt: skip
def test_aiters_standalone_call_takes_the_backends_path_from_its_source_tree(
    backend: str, flash_kda: bool, segment: str | None, extra: str | None, aiter_tree: None
) -> None:
    """chunk_kimi_delta_attn as the repro file calls it, from a source checkout (KDA_AITER_SRC) without running
    aiter/__init__.py (the HIP build; the double raises there): FlashKDA on or off and the segment length as
    the backend pins them, the state in fp32, the result the float64 truth's."""
    from kda_kernels import registry

    case = Case(seq_lens=(20, 33), packed=True, initial_state="random", num_heads=2, num_v_heads=2, head_k_dim=32,
                head_v_dim=32, seed=5)  # fmt: skip
    chosen = registry.get(backend)
    namespace = with_call(chosen, case)
    x = namespace["draw"](namespace["CASE"])
    kwargs = {k: v for k, v in materialize(case).kernel_kwargs().items() if k not in ("initial_state", "cu_seqlens")}
    o, final = namespace["call"](x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], x["cu_seqlens"],
                                 **kwargs)  # fmt: skip
    [called] = sys.modules["aiter.ops.triton.kimi_delta_attn"].CALLS
    # On the FlashKDA path the file asks AITER's own admission check first, as the backend does.
    assert sys.modules["aiter.ops.triton.kimi_delta_attn"].ADMISSIONS == ([True] if flash_kda else [])
    assert called == {"flash_kda": flash_kda, "segment": segment, "safe_gate": case.safe_gate, "chunk_size": None,
                      "backend": extra, "state_dtype": torch.float32, "dt_bias": True}  # fmt: skip
    if extra == "native":  # the native port gets a dt_bias where the caller has none, as its adapter gives it
        kwargs_without = {**kwargs, "dt_bias": None}
        namespace["call"](x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["cu_seqlens"], **kwargs_without)
        assert sys.modules["aiter.ops.triton.kimi_delta_attn"].CALLS[-1]["dt_bias"]
    want_o, want_final = kda_token_loop(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                        cu_seqlens=x["cu_seqlens"], **kwargs)  # fmt: skip
    for got, want in ((o, want_o), (final, want_final)):
        assert got.shape == want.shape
        assert float((got.double() - want).norm() / want.norm()) < 1e-2


def test_aiters_standalone_file_fails_where_aiter_would_not_take_the_flashkda_path(aiter_tree: None) -> None:
    """An H100 run of AITER's zero-length file gave the default pipeline's numbers to three digits: a file for the
    FlashKDA path says what AITER's admission check answered, and fails where it refuses (a raw gate here)."""
    from kda_kernels import registry

    case = Case(seq_lens=(20,), num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16, seed=3)
    namespace = with_call(registry.get("aiter_flashkda"), case)
    x = namespace["draw"](namespace["CASE"])
    kwargs = {k: v for k, v in materialize(case).kernel_kwargs().items() if k not in ("initial_state", "cu_seqlens")}
    with pytest.raises(AssertionError, match="refuses the FlashKDA path"):
        namespace["call"](x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, **{**kwargs, "A_log": None})
    assert sys.modules["aiter.ops.triton.kimi_delta_attn"].CALLS == []  # nothing ran on another path


def test_aiters_standalone_call_skips_naming_aiter_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from kda_kernels import registry

    monkeypatch.delenv("KDA_AITER_SRC", raising=False)
    for name in [n for n in sys.modules if n == "aiter" or n.startswith("aiter.")]:  # bare packages of a tree
        monkeypatch.delitem(sys.modules, name)
    if importlib.util.find_spec("aiter") is not None:
        pytest.skip("AITER is installed here")
    case = Case(seq_lens=(9,), head_k_dim=16, head_v_dim=16)
    chosen = registry.get("aiter_flashkda")
    namespace = with_call(chosen, case)
    with pytest.raises(pytest.skip.Exception, match="needs AITER"):
        namespace["call"](*(None,) * 7)
    assert registry.get("aiter_paged").standalone_source is None  # its findings are the paged API's


@pytest.mark.slow
def test_a_gradient_findings_file_takes_the_kernels_backward_alone_and_gives_the_suites_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finding of the gradients check (fake_kda's backward drops dbeta at each sequence's last token) becomes a
    file that takes the kernel's own backward and float64 gradients through the plain token loop, nothing of the
    suite: it fails naming dbeta's first bad token, measures what the suite measured, passes once the library is
    fixed and skips without it. A finding whose whole backward was within its limits gets no file."""

    path = os.pathsep.join([str(PLUGINS), str(DOUBLES), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    case = Case(seq_lens=(20, 17), packed=True, initial_state="random", num_heads=1, num_v_heads=2, head_k_dim=16,
                head_v_dim=16)  # fmt: skip
    store, written = tmp_path / "store", tmp_path / "findings"
    cli = [sys.executable, "-c", "import sys; from kda_conformance.cli import main; sys.exit(main(sys.argv[1:]))"]
    repro = [*cli, "repro", "--device", "cpu", "--plugin", "kda_fake_library", "--backend", "fake_kda_chunk"]
    done = subprocess.run([*repro, "--check", "gradients", "--case", case.to_json(), "--out", str(store)], env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 1 and "tensor dbeta" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    findings = [*cli, "findings", "--store", str(store), "--plugin", "kda_fake_library", "--device", "cpu"]
    done = subprocess.run([*findings, "--write-tests", str(written)], env=env, capture_output=True, text=True)
    assert "fails today on cpu; the suite's gradients check fails here" in done.stdout, done.stdout[-3000:]
    [file] = written.glob("test_*.py")
    text = file.read_text()
    assert imports_of_the_suite(text) == [] and "TERM_RMS = {'dg':" in text and "sum(o * d_o)" in text
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / file.name).write_text(text)
    bare = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pytest_file = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:randomly", "-s",
                   file.name]  # fmt: skip
    fails = subprocess.run(pytest_file, cwd=alone, env={**bare, "PYTHONPATH": str(DOUBLES)}, capture_output=True,
                           text=True)  # fmt: skip
    assert fails.returncode == 1 and "dbeta: max_abs" in fails.stdout, fails.stdout[-3000:]
    assert "first at (row, token, head) (0, 19, 0)" in fails.stdout  # the first sequence's last token
    # Every gradient measured as the suite measured it: the numbers now and when written agree to the digits shown.
    lines = [line for line in fails.stdout.splitlines() if line.startswith(("dq:", "dg:", "dbeta:", "dh0:", "dA_log:"))]
    assert len(lines) == 5
    for line in lines:
        now = line.split("max-abs ")[1].split(" ")[0]
        assert f"when written {now}," in line, line
    fixed = subprocess.run(pytest_file, cwd=alone, env={**bare, "PYTHONPATH": str(DOUBLES), "FAKE_KDA_FIXED": "1"},
                           capture_output=True, text=True)  # fmt: skip
    assert fixed.returncode == 0 and "1 passed" in fixed.stdout, fixed.stdout[-3000:]
    skips = subprocess.run(pytest_file, cwd=alone, env=bare, capture_output=True, text=True)
    assert skips.returncode == 0 and "needs fake-kda" in skips.stdout, skips.stdout[-3000:]

    report = subprocess.run([*findings, "--report", file.read_text().removeprefix('"""').split(":")[0]], env=env,
                            capture_output=True, text=True)  # fmt: skip
    assert "| fake_kda_chunk | gradients | dbeta | 8.995e-01 |" in report.stdout, report.stdout[-3000:]
    assert "dbeta alone) | dbeta |" in report.stdout  # the worst of its sequences alone, apart

    monkeypatch.syspath_prepend(str(DOUBLES))
    monkeypatch.syspath_prepend(str(PLUGINS))
    importlib.import_module("kda_fake_library")  # registers fake_kda_chunk here
    [finding] = [f for f in upstream_findings(load_store(store).records, ()) if f.status == "new"]
    calm = tuple(dataclasses.replace(m, max_abs=0.0, rel_rms=0.0) for m in finding.measured)
    said = write_finding_test(dataclasses.replace(finding, measured=calm), torch.device("cpu"), tmp_path / "none")
    assert said.test.startswith("not written: its whole backward was within every limit"), said.test


def _cold_read_file(nonfinite: int) -> str:
    """A file for a finding of a kernel whose output it never writes (``torch.empty``), measured with
    ``nonfinite`` non-finite values."""
    from kda_conformance.repro.standalone_finding import standalone_file_text
    from kda_conformance.repro.upstream import Measured, UpstreamFinding
    from kda_kernels.torch_chunk import TorchChunk

    class ColdRead(TorchChunk):
        name = "cold_read"

        def standalone_source(self, case: Case) -> str:
            return (
                "\n\ndef call(q, k, v, g, beta, initial_state, cu_seqlens, **kwargs):\n"
                "    final = torch.zeros(2, v.shape[2], q.shape[-1], v.shape[-1])\n"
                "    return torch.empty(v.shape, dtype=v.dtype), final  # the output never written\n"
            )

    case = Case(seq_lens=(5, 3), packed=True, num_heads=1, num_v_heads=1, head_k_dim=8, head_v_dim=8)
    errors = (9.0, 9.0, 1e-3, 1e-3, 1e-4, 1e-4, 1e-5, 1.0, "baseline", "baseline", math.nan, nonfinite, "-", "")
    measured = tuple(Measured("cold_read", "budget", tensor, *errors) for tensor in ("o", "final_state"))
    finding = UpstreamFinding(
        "cold-read", "cold_read", "a test", "new", "r", "budget", 1, "inf", "-", case.id, case.to_json(), "-",
        "its output is never written", measured=measured, environment="cpu (a test)",
    )  # fmt: skip
    return standalone_file_text(finding, case, ColdRead(), "test_cold_read.py")


def test_a_finding_measured_non_finite_calls_its_kernel_with_unwritten_memory_poisoned() -> None:
    """On an H100 AITER's zero-length file, run alone in a fresh process, gave finite wrong values where the suite
    had measured inf (fresh device memory is zeros): a non-finite finding's file now poisons what the kernel does
    not write, as the suite's poisoned scratch does, so the read shows as NaN wherever the file runs."""
    text = _cold_read_file(nonfinite=64)
    assert imports_of_the_suite(text) == [] and 'with poisoned_scratch(torch.device(device), "nan"):' in text
    namespace: dict = {"__name__": "test_cold_read"}
    exec(compile(text, "test_cold_read.py", "exec"), namespace)
    with pytest.raises(AssertionError, match=r"o: 64 non-finite values"):
        namespace["test_cold_read"]()
    assert not torch.are_deterministic_algorithms_enabled()  # the switches it sets are put back
    # A finding whose values were finite calls its kernel as it is.
    plain = _cold_read_file(nonfinite=0)
    assert "poisoned_scratch" not in plain and "with contextlib.nullcontext():" in plain
