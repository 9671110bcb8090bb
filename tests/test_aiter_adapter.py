"""The AITER adapters (kernels/backends/aiter.py) against a TEST DOUBLE of AITER's chunk_kimi_delta_attn
(tests/plugins/aiter_double: AITER's signature, switch and checks over this suite's float64 reference).

What is tested here is the adapter: how it imports AITER without its HIP build, translates a case into
AITER's arguments and layouts, switches FlashKDA per backend, pins the segment length, states its
envelopes, calls the paged API, and marks gfx950 tests. AITER's numerics are the H200's and MI355X's job.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from budget_of import budget_check
from suite_paths import REPO

from kda_cases.case import Case
from kda_conformance.checks import get_check, run_check
from kda_conformance.running.truth import case_truth
from kda_kernels import registry
from kda_kernels.backends import aiter as adapter

DOUBLE = Path(__file__).with_name("plugins") / "aiter_double"
CPU = torch.device("cpu")
FLASH_CASE = Case(seq_lens=(40,), num_heads=1, num_v_heads=1, head_k_dim=128, head_v_dim=128, initial_state="random")


def _forget_aiter() -> None:
    for name in [n for n in sys.modules if n == "aiter" or n.startswith("aiter.")]:
        del sys.modules[name]


@pytest.fixture
def double(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict]]:
    """The double on KDA_AITER_SRC; yields its call log. AITER's modules are forgotten afterwards."""
    _forget_aiter()
    monkeypatch.setenv("KDA_AITER_SRC", str(DOUBLE))
    monkeypatch.delenv("CHUNK_DELTA_ATTN_FLASH_KDA_SEG", raising=False)
    registry.get("aiter_default").entry()  # imports the double through the adapter's own path
    yield importlib.import_module("aiter.ops.triton._triton_kernels.kimi_delta_attn.chunk_fwd").CALLS
    _forget_aiter()


def test_import_skips_aiters_init_and_sets_triton_only(double: list[dict]) -> None:
    # The double's aiter/__init__.py raises if run: getting here means the bare packages were used.
    assert os.environ["AITER_TRITON_ONLY"] == "1"
    assert all(registry.get(name).availability(CPU) for name in ("aiter_flashkda", "aiter_default", "aiter_paged"))


def test_missing_aiter_is_a_reason_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    _forget_aiter()
    monkeypatch.delenv("KDA_AITER_SRC", raising=False)
    assert "need a GPU" in registry.get("aiter_flashkda").availability(CPU).reason
    monkeypatch.setenv("KDA_AITER_SRC", "/nonexistent")
    assert "holds no aiter/ops/triton" in registry.get("aiter_flashkda").availability(CPU).reason


@pytest.mark.parametrize(
    ("backend", "path", "segment"),
    [
        ("aiter_flashkda", "flash_kda", None),
        ("aiter_flashkda_seg16", "flash_kda", "16"),
        ("aiter_flashkda_unsegmented", "flash_kda", "0"),
        ("aiter_default", "default", None),
    ],
)
def test_each_backend_runs_its_path_with_aiters_arguments(
    double: list[dict], backend: str, path: str, segment: str | None
) -> None:
    findings = budget_check(case_truth(FLASH_CASE, CPU), registry.get(backend))
    assert {f.verdict for f in findings} == {"pass"}, [f.message() for f in findings]
    call = double[-1]
    assert (call["path"], call["segment"]) == (path, segment)
    assert call["chunk_size"] is None and call["chunk"] == (32 if path == "flash_kda" else 64)
    assert call["safe_gate"] and call["output_final_state"] and call["initial_state_dtype"] == torch.float32
    # The switch and the segment variable are AITER's again after the call.
    flash = importlib.import_module("aiter.ops.triton._triton_kernels.kimi_delta_attn.flash_kda")
    assert flash.AITER_FDA_ENABLE is True and "CHUNK_DELTA_ATTN_FLASH_KDA_SEG" not in os.environ


def test_state_layout_bf16_pool_and_packing_are_translated(double: list[dict]) -> None:
    case = FLASH_CASE.replace(seq_lens=(30, 0, 17), packed=True, state_layout="v_first", state_dtype="bf16")
    findings = budget_check(case_truth(case, CPU), registry.get("aiter_flashkda"))
    assert {f.verdict for f in findings} == {"pass"}, [f.message() for f in findings]
    assert double[-1]["state_v_first"] and double[-1]["cu_seqlens_dtype"] is not None


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"dtype": "fp16"}, "dtypes bf16 (the case has fp16)"),
        ({"head_k_dim": 64, "head_v_dim": 64}, "head_dims 128 (the case has K=64, V=64)"),
        ({"num_v_heads": 2}, "no GVA"),
        ({"gate": "log"}, "gates lower_bound (the case has log)"),
        ({"lower_bound": -6.0}, "in_kernel_lower_bound [-5, 0) with the safe gate in the kernel"),
    ],
)
def test_envelopes_say_why(change: dict, reason: str) -> None:
    case = FLASH_CASE.replace(**change)
    verdict = registry.get("aiter_flashkda").supports(case)
    assert not verdict and reason in verdict.reason
    default_ok = registry.get("aiter_default").supports(case)
    assert bool(default_ok) == ("lower_bound" not in change), default_ok.reason
    assert registry.get("aiter_flashkda").supports(registry.get("aiter_flashkda").fit(case)) or "lower_bound" in change


def test_paged_api_is_called_in_place_and_survives_poison(double: list[dict]) -> None:
    case = FLASH_CASE.replace(seq_lens=(20, 0, 13), packed=True, state_layout="v_first")
    paged = registry.get("aiter_paged")
    assert paged.supports(case) and not paged.supports(case.replace(state_layout="k_first"))
    for poison in ("nan", "tenant"):
        assert not [f for f in run_check(get_check("poison"), case, paged, CPU, {"poison": poison}) if f.failed]
    assert double[-1]["paged"] and double[-1]["path"] == "flash_kda"


def test_native_needs_its_parameter_and_arch(double: list[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    native = registry.get("aiter_native")
    assert "gfx942 and gfx950 only" in native.availability(CPU).reason
    monkeypatch.setattr(adapter, "gpu_arch", lambda device: "gfx950")
    assert "has no backend parameter" in native.availability(CPU).reason


def test_gfx950_marker_comes_from_backend_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert registry.get("aiter_flashkda").markers(CPU) == ()
    monkeypatch.setattr(adapter, "gpu_arch", lambda device: "gfx950")
    assert registry.get("aiter_flashkda").markers(CPU) == ("gfx950",)
    assert registry.get("fla_chunk").markers(CPU) == ()


def test_pytest_m_gfx950_selects_what_the_markers_say(tmp_path: Path) -> None:
    """A backend whose markers() name gfx950 is selected by -m gfx950; the others are not."""
    plugin = tmp_path / "kda_fake_gfx950.py"
    plugin.write_text(
        "from kda_kernels.registry import register\n"
        "from kda_kernels.torch_chunk import TorchChunk\n\n\n"
        "class OnGfx950(TorchChunk):\n"
        "    name = 'fake_gfx950'\n\n"
        "    def markers(self, device):\n"
        "        return ('gfx950',)\n\n\n"
        "register(OnGfx950.name, OnGfx950)\n"
    )
    args = [sys.executable, "-m", "pytest", "conformance/test_corpus.py", "--collect-only", "-q", "-m", "gfx950"]
    args += ["--kda-device", "cpu", "--kda-plugin", "kda_fake_gfx950", "--kda-backend", "fake_gfx950"]
    args += ["--kda-backend", "torch_chunk"]
    done = subprocess.run(
        args, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(tmp_path)}, check=False
    )
    selected = [line for line in done.stdout.splitlines() if "::" in line]
    assert selected and all("fake_gfx950" in line for line in selected), done.stdout[-2000:]


@pytest.mark.slow
def test_the_conformance_tests_run_the_adapters_against_the_double(tmp_path: Path) -> None:
    """What AMD CI runs with `-m gfx950`, here on the CPU with the double: drawn cases moved into each
    backend's envelope (K = V = 128, bf16, ...), within budget, served with poison, reused cu_seqlens."""
    args = [sys.executable, "-m", "pytest", "conformance/test_properties.py", "conformance/test_serving.py", "-q"]
    args += ["-k", "within_budget or poisoned or reused", "--kda-device", "cpu", "--kda-out", str(tmp_path)]
    args += [arg for name in ("aiter_flashkda", "aiter_default", "aiter_paged") for arg in ("--kda-backend", name)]
    env = {**os.environ, "KDA_AITER_SRC": str(DOUBLE)}
    done = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env, check=False)
    assert done.returncode == 0 and "9 passed" in done.stdout, done.stdout[-3000:]
