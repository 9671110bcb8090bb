"""Every autotune configuration (conformance/checks/autotune_configs.py), on the CPU against a backend that
launches a test double of a JIT kernel under Triton's own ``triton.autotune``: each configuration is pinned
once, the one that computes wrong is named, the others pass; the winners are back in place afterwards."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from fake_jit import FakeJit

triton = pytest.importorskip("triton")

from kda_cases.case import Case  # noqa: E402
from kda_conformance.checks import get_check, run_check  # noqa: E402
from kda_conformance.checks.autotune_configs import describe  # noqa: E402
from kda_conformance.running.config import build_config  # noqa: E402
from kda_conformance.running.faults import DeviceLost  # noqa: E402
from kda_conformance.running.run import Run  # noqa: E402
from kda_kernels import autotune_replay as replay  # noqa: E402
from kda_kernels import registry  # noqa: E402
from kda_kernels.protocol import BackendOutput  # noqa: E402
from kda_kernels.torch_chunk import TorchChunk  # noqa: E402

TIMES = {16: 3.0, 32: 1.0, 64: 2.0}  # BLOCK -> the benchmark's time: autotune picks 32
WRONG_BLOCK = 64  # the configuration that computes wrong (it never wins the benchmark)


def scale_tail(x, n, BLOCK):
    """The Python function under the JIT."""


JIT = FakeJit(scale_tail)


def _bench(kernel_call, quantiles=None, **kwargs):
    kernel_call()
    return [TIMES[JIT.launched[-1]]] * 3


TUNED = triton.autotune(
    configs=[triton.Config({"BLOCK": block}, num_warps=4) for block in TIMES], key=["n"], do_bench=_bench
)(JIT)


class TunedBaseline(TorchChunk):
    """The baseline, whose output passes through the autotuned kernel: right with every BLOCK but one."""

    name = "test_tuned_baseline"

    def run(self, inputs):
        out = super().run(inputs)
        TUNED.run(None, inputs.case.total_tokens)
        if JIT.launched[-1] == WRONG_BLOCK:
            return BackendOutput(o=out.o * 1.5, final_state=out.final_state)
        return out


@pytest.fixture
def tuned(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from triton.runtime.autotuner import Autotuner

    # Triton's own autotuning: the CPU interpreter's workaround (which launches the first config) set aside.
    monkeypatch.setattr(Autotuner, "run", getattr(Autotuner.run, "__wrapped__", Autotuner.run))
    monkeypatch.delenv(replay.RECORD_VARIABLE, raising=False)
    registry.register(TunedBaseline.name, TunedBaseline, replace=True)
    TUNED.cache.clear()
    yield
    replay.uninstall()


def test_each_configuration_is_pinned_once_and_the_wrong_one_is_named(tuned: None, tmp_path) -> None:
    check = get_check("autotune_configs")
    assert check.applies(registry.get("torch_chunk"), "cpu"), "a GPU check: the CPU interpreter pins nothing"
    check = dataclasses.replace(check, devices=("cpu", "cuda"))  # here, for the double
    case = Case(seq_lens=(40,), num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    run = Run(build_config(device="cpu", out=tmp_path), journal=False)
    findings = run_check(check, case, registry.get(TunedBaseline.name), torch.device("cpu"), {}, run)
    # Tuned once (3 benchmarks, then the winner's launch), then each BLOCK pinned once, with no benchmark.
    assert JIT.launched == [16, 32, 64, 32, 16, 32, 64]
    failed = {f.subject for f in findings if f.failed}
    wrong = describe(replay.kernel_name(TUNED), replay.config_dict(TUNED.configs[2]))
    assert wrong == "scale_tail BLOCK=64 warps=4 stages=3"
    assert failed == {f"with {wrong}"}, failed
    assert {f.subject for f in findings if f.passed} >= {
        "autotune's choices",
        "with scale_tail BLOCK=16 warps=4 stages=3",
    }
    # The winner is back: the next call launches BLOCK 32 with no benchmark.
    TUNED.run(None, 40)
    assert JIT.launched[-1] == 32 and len(JIT.launched) == 8


class FaultsWithOneConfiguration(TunedBaseline):
    """The tuned baseline, but the device is lost (an illegal memory access) when the wrong BLOCK is launched."""

    name = "test_faults_with_one_configuration"

    def run(self, inputs):
        out = super().run(inputs)
        if JIT.launched[-1] == WRONG_BLOCK:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return out


class TooLargeForOneConfiguration(TunedBaseline):
    """The tuned baseline, but BLOCK 16 asks more shared memory than the GPU has, as Triton says when it compiles
    (on an H100, GLM-5.3-Flash's AMD copy at K = V = 256 fp16 with 4 stages: 282,624 bytes of 232,448)."""

    name = "test_too_large_for_one_configuration"

    def run(self, inputs):
        out = super().run(inputs)
        if JIT.launched[-1] == 16:
            raise triton.runtime.errors.OutOfResources(282624, 232448, "shared memory")
        return out


def test_a_configuration_this_gpu_cannot_launch_is_a_skip_that_says_why(tuned: None, tmp_path) -> None:
    """Triton's autotuner never chooses a configuration that is out of resources here: the check skips it naming
    the resource, and still names the one that computes wrong."""
    registry.register(TooLargeForOneConfiguration.name, TooLargeForOneConfiguration, replace=True)
    check = dataclasses.replace(get_check("autotune_configs"), devices=("cpu", "cuda"))
    case = Case(seq_lens=(40,), num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    run = Run(build_config(device="cpu", out=tmp_path), journal=False)
    findings = run_check(check, case, registry.get(TooLargeForOneConfiguration.name), torch.device("cpu"), {}, run)
    [skipped] = [f for f in findings if f.verdict == "skip"]
    assert skipped.subject == "with scale_tail BLOCK=16 warps=4 stages=3"
    assert skipped.observed == "configuration does not fit this GPU"
    assert "autotune never chooses it here: out of resource: shared memory, Required: 282624" in skipped.reason
    assert {f.subject for f in findings if f.failed} == {"with scale_tail BLOCK=64 warps=4 stages=3"}


def _lost_device_error(tmp_path):
    """The error finding the check leaves when the faulting double loses the device."""
    registry.register(FaultsWithOneConfiguration.name, FaultsWithOneConfiguration, replace=True)
    check = dataclasses.replace(get_check("autotune_configs"), devices=("cpu", "cuda"))
    case = Case(seq_lens=(40,), num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    run = Run(build_config(device="cpu", out=tmp_path), journal=False)
    with pytest.raises(DeviceLost) as lost:
        run_check(check, case, registry.get(FaultsWithOneConfiguration.name), torch.device("cpu"), {}, run)
    [error] = lost.value.findings
    assert error.verdict == "error" and "illegal memory access" in error.reason, error
    return error


def test_a_configuration_that_loses_the_device_is_named_in_the_record(tuned: None, tmp_path) -> None:
    """A configuration that faults ends the process (the device is lost), and the error it leaves names the
    configuration that was pinned: on an H100 vLLM's GLM AMD copy faulted in processes that tuned, where the
    configuration at fault is not known."""
    error = _lost_device_error(tmp_path)
    assert error.reason.endswith("; with scale_tail BLOCK=64 warps=4 stages=3 pinned (3 of 3 configurations tried)")


def test_a_fault_while_autotune_tunes_says_no_configuration_was_pinned(tuned: None, tmp_path, monkeypatch) -> None:
    """Tuning launches every configuration, the faulting one too: the error says so, not a pinned one."""
    monkeypatch.setitem(TIMES, WRONG_BLOCK, 0.5)  # the faulting configuration wins: the first call faults
    said = "; with autotune's choices, before any configuration was pinned (tuning runs them all)"
    assert _lost_device_error(tmp_path).reason.endswith(said)


def test_past_its_time_the_configurations_left_are_said_not_judged(tuned: None, tmp_path, monkeypatch) -> None:
    from kda_conformance.checks import autotune_configs

    monkeypatch.setattr(autotune_configs, "SECONDS", -1.0)
    check = dataclasses.replace(get_check("autotune_configs"), devices=("cpu", "cuda"))
    case = Case(seq_lens=(40,), num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    run = Run(build_config(device="cpu", out=tmp_path), journal=False)
    findings = run_check(check, case, registry.get(TunedBaseline.name), torch.device("cpu"), {}, run)
    [cut] = [f for f in findings if f.observed == "cut"]
    assert cut.reason == "0 of 3 configurations tried in -1 s; the rest not" and not any(f.failed for f in findings)


def test_a_backend_without_autotuned_kernels_passes_saying_so(tuned: None, tmp_path) -> None:
    check = get_check("autotune_configs")
    check = dataclasses.replace(check, devices=("cpu", "cuda"))
    case = Case(seq_lens=(37,), num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    run = Run(build_config(device="cpu", out=tmp_path), journal=False)
    findings = run_check(check, case, registry.get("torch_chunk"), torch.device("cpu"), {}, run)
    assert [f.observed for f in findings if f.subject == "autotuned kernels"] == ["none with a choice"]
    assert not any(f.failed for f in findings)


@pytest.mark.slow
def test_a_costly_check_runs_its_own_number_of_examples(tmp_path) -> None:
    """The profile gives every check 12 examples; a check that declares 2 runs 2 (the autotune one declares 1)."""
    from suite_paths import ENV, pytest_run

    count = tmp_path / "count"
    done = pytest_run(
        "conformance/test_properties.py", "-k", "capped_probe", "--kda-plugin",
        "kda_capped_check", "--kda-backend", "torch_chunk", "--kda-profile", "cpu-nightly", "--kda-seed", "1",
        "--kda-out", str(tmp_path / "store"), env={**ENV, "KDA_TEST_CAPPED_COUNT": str(count)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert count.read_text() == "2"
    assert get_check("autotune_configs").max_examples == 1


@pytest.mark.slow
def test_a_draw_the_check_cannot_run_on_is_replaced_and_none_at_all_is_a_skip(tmp_path) -> None:
    """Seen on an H100: a 2^31 batch past the device's memory, and a first draw with no boundary to move, failed
    their tests as errors; a draw the check does not apply to is now rejected and another drawn."""
    from suite_paths import ENV, pytest_run

    count = tmp_path / "count"
    done = pytest_run(
        "conformance/test_properties.py", "-k", "picky_probe or never_probe", "--kda-plugin", "kda_capped_check",
        "--kda-backend", "torch_chunk", "--kda-profile", "cpu-nightly", "--kda-seed", "1", "-rs",
        "--kda-out", str(tmp_path / "store"), env={**ENV, "KDA_TEST_CAPPED_COUNT": str(count)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert count.read_text() == "2"  # two draws of an even number of tokens ran, the odd ones were redrawn
    assert "1 passed, 1 skipped" in done.stdout, done.stdout[-2000:]
    assert "no case drawn for torch_chunk could run here; the last: check never_probe does not apply" in done.stdout


@pytest.mark.slow
def test_one_seed_draws_the_same_examples_in_every_run(tmp_path) -> None:
    """Hypothesis reads a test's seed from the function ``given`` made; set on the wrapper pytest collects, it was
    ignored, and every run of one nightly seed drew other cases after the first (seen on the CPU: four runs of
    ``--kda-seed 5403`` gave four second examples)."""
    from suite_paths import ENV, pytest_run

    def drawn(seed: str, run: str) -> list[str]:
        path = tmp_path / f"drawn-{run}"
        done = pytest_run(
            "conformance/test_properties.py", "-k", "drawn_probe", "--kda-plugin", "kda_capped_check",
            "--kda-backend", "torch_chunk", "--kda-profile", "cpu-nightly", "--kda-seed", seed,
            "--kda-out", str(tmp_path / run), env={**ENV, "KDA_TEST_DRAWN": str(path)},
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:]
        return path.read_text().split()

    first = drawn("7", "a")
    assert len(set(first)) == 3
    assert drawn("7", "b") == first
