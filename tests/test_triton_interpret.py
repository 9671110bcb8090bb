"""Each CPU interpreter workaround works, and each is still needed.

Every probe runs in a fresh process (tests/interpret_probe.py): the interpreter
and the patches are process-wide. If a test of the form "without X, ... fails"
starts failing, Triton or FLA fixed that gap: drop the workaround.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kda_kernels import triton_interpret

PROBE = Path(__file__).with_name("interpret_probe.py")

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.skipif(
        triton_interpret.problem() != "" and "pinned" in triton_interpret.problem(),
        reason="the interpreter workarounds are pinned to triton " + triton_interpret.PINNED_TRITON,
    ),
]


@functools.cache
def probe(name: str, *skip: str, tf32: str | None = None) -> dict:
    """``tf32``: KDA_INTERPRET_TF32 for the probe's process (None: as this process has it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if tf32 is not None:
        env[triton_interpret.TF32_VARIABLE] = tf32
    done = subprocess.run(
        [sys.executable, str(PROBE), name, *skip], capture_output=True, text=True, timeout=300, env=env
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"probe {name} printed no result; stderr:\n{done.stderr[-2000:]}"
    return json.loads(lines[-1])


def test_bf16_cast_rounds_to_nearest_even() -> None:
    assert probe("cast") == {"mismatches": 0}


def test_bf16_cast_truncates_without_the_workaround() -> None:
    assert probe("cast", "bf16_round")["mismatches"] > 100


def test_bf16_arithmetic_matches_torch() -> None:
    assert probe("arith") == {"mismatches": 0}


def test_bf16_arithmetic_runs_on_raw_bits_without_the_workaround() -> None:
    assert probe("arith", "bf16_arith").get("mismatches", 0) > 100


def test_bf16_reductions_and_scans_match_torch() -> None:
    said = probe("reduce")
    assert said["total_error"] <= 0.05 and said["prefix_error"] <= 0.05, said  # a bf16 unit at the sums' size


def test_bf16_reductions_run_on_raw_bits_without_the_workaround() -> None:
    said = probe("reduce", "bf16_reduce")
    assert "exception" in said or said["total_error"] > 1 or said["prefix_error"] > 1, said


@pytest.mark.slow
def test_fp32_chunk_kda_matches_fp64() -> None:
    assert probe("chunk_fp32")["max_abs"] < 1e-6


@pytest.mark.slow
def test_autotuner_needs_a_gpu_without_the_workaround() -> None:
    assert "0 active drivers" in probe("chunk_fp32", "autotune")["exception"]


@pytest.mark.slow
def test_loop_index_to_fails_without_the_workaround() -> None:
    assert "has no attribute 'to'" in probe("chunk_fp32", "loop_index")["exception"]


@pytest.mark.slow
def test_flas_gather_alias_fails_without_the_builtin_alias_workaround() -> None:
    assert "Did you forget to add @triton.jit" in probe("chunk_fp32", "builtin_alias")["exception"]


def test_a_builtin_called_through_a_module_alias_runs() -> None:
    assert probe("alias")["max_abs"] < 1e-6


def test_a_builtin_alias_fails_without_the_workaround() -> None:
    # Raised inside the launch, on its own thread (shallow_stack): the caller gets the kernel's error.
    assert "Did you forget to add @triton.jit" in probe("alias", "builtin_alias")["exception"]


@pytest.mark.slow
def test_bf16_chunk_kda_has_gpu_like_error() -> None:
    # On an H200, chunk_kda's bf16 max-abs output error at T=37 is about 3e-4 to 1e-3.
    assert probe("chunk_bf16")["max_abs"] < 2e-3


@pytest.mark.slow
def test_bf16_chunk_kda_is_garbage_without_bf16_arithmetic() -> None:
    result = probe("chunk_bf16", "bf16_arith")
    assert "exception" in result or not result["max_abs"] < 1.0


@pytest.mark.slow
def test_bf16_chunk_kda_error_grows_without_rounding() -> None:
    assert probe("chunk_bf16", "bf16_round")["max_abs"] > 2 * probe("chunk_bf16")["max_abs"]


def test_each_launch_runs_on_a_thread_of_its_own_with_the_callers_inference_mode() -> None:
    """The shallow-stack workaround (a cost, timed by tests/interpreter_bench.py, not a gap): the same results,
    each launch on its own thread, seeing the inference mode its caller was in."""
    said = probe("launch_thread")
    assert said["max_abs"] < 1e-6, said
    assert said["seen"] == [["triton-interpreter-launch", True], ["triton-interpreter-launch", False]], said
    alone = probe("launch_thread", "shallow_stack")
    assert alone["max_abs"] < 1e-6 and [name for name, _ in alone["seen"]] == ["MainThread"] * 2, alone


def test_triton_language_is_patched_once_a_launch_for_each_module() -> None:
    """The patch-once workaround (a cost, timed by tests/interpreter_bench.py): the same results, and
    triton.language left as found, patched once a launch for the kernel's module (its device function's too)
    instead of at the launch and again at each of its three device calls."""
    said, alone = probe("patch_once"), probe("patch_once", "patch_once")
    assert said["patches"] == ["triton.language"] * 2 and said["restored"], said
    assert alone["patches"] == ["triton.language"] * 8 and alone["restored"], alone
    assert said["max_rel"] == alone["max_rel"] < 1e-6


@pytest.mark.parametrize("mode", ["truncated", "nearest"])
def test_tf32_dots_take_their_operands_as_an_nvidia_gpu_when_asked(mode: str) -> None:
    """KDA_INTERPRET_TF32: a float32 dot at the default precision (TF32 on NVIDIA) takes its operands cut or
    rounded to TF32, within float32's rounding of that product and far from the exact one; an "ieee" dot keeps
    them. Products of 16 standard normals: a TF32 operand is off by up to 2^-11 (nearest) or 2^-10 (cut) of
    itself, float32's accumulation by about 2^-24 of the sum."""
    said = probe("tf32_dot", tf32=mode)
    assert said[f"tf32_vs_{mode}"] < 1e-5 < 1e-3 < said["tf32_vs_exact"], said
    assert said["ieee_vs_exact"] < 1e-5, said


def test_tf32_dots_are_the_interpreters_own_by_default() -> None:
    said = probe("tf32_dot", tf32="")
    assert said["tf32_vs_exact"] < 1e-5 and said["ieee_vs_exact"] < 1e-5, said


def test_an_unknown_tf32_mode_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(triton_interpret.TF32_VARIABLE, "half")
    with pytest.raises(triton_interpret.TritonInterpretError, match=r"KDA_INTERPRET_TF32='half'.*ieee, truncated"):
        triton_interpret.tf32_mode()


def test_enable_rejects_unknown_workaround_names() -> None:
    with pytest.raises(ValueError, match="unknown workarounds"):
        triton_interpret.enable(skip=["no_such_thing"])


@pytest.mark.slow
def test_fla_workarounds_wait_for_fla_and_apply_whoever_imports_it() -> None:
    """Switching the interpreter on imports no FLA (seconds a process); FLA imported afterwards by any code
    (a standalone repro file, not the suite's adapter) still gets its workaround."""
    code = (
        "import sys; from kda_kernels import triton_interpret; triton_interpret.enable(); "
        "assert 'fla' not in sys.modules, 'enable() imported FLA'; "
        "import fla.ops.kda.chunk_intra as intra; "
        "assert intra.range is triton_interpret._loop_range, 'the loop-index workaround was not applied'; "
        "print('ok')"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
