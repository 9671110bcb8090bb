"""Each call in a clean world (kernels/world.py): what a backend may set, the global RNG, the suite's
definitions and the truths a run holds, taken before a call and put back after it."""

from __future__ import annotations

import dataclasses
import gc
import os

import pytest
import torch

from kda_cases.case import Case
from kda_cases.materialize import KDAInputs, materialize
from kda_conformance.running.truth import CaseTruth, case_truth
from kda_kernels import guard, world
from kda_kernels.protocol import BackendOutput, Support
from kda_kernels.torch_chunk import TorchChunk
from kda_reference import run as reference_run
from kda_reference.run import run_reference

CASE = Case(seq_lens=(37,), initial_state="random", num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_breaches_left() -> None:
    guard.take_breaches()
    yield
    guard.take_breaches()


class Sets(TorchChunk):
    name = "sets_declared"
    sets_environment = ("HOSTILE_TEST_DECLARED_SWITCH",)  # a library's switch, not one of the suite's

    def run(self, inputs: KDAInputs) -> BackendOutput:
        os.environ[self.sets_environment[0]] = "on"
        return super().run(inputs)


def test_a_variable_the_backend_declares_is_kept_and_no_failure() -> None:
    variable = Sets.sets_environment[0]
    try:
        guard.run_backend_call(Sets(), materialize(CASE, CPU))
        assert os.environ.get(variable) == "on"
        assert guard.take_breaches() == []
    finally:
        os.environ.pop(variable, None)


def test_a_variable_torch_sets_on_first_use_is_kept_but_changing_it_is_not(monkeypatch) -> None:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)

    class FirstUse(TorchChunk):
        name = "uses_inductor_cache"

        def run(self, inputs: KDAInputs) -> BackendOutput:
            cache_dir()  # torch sets TORCHINDUCTOR_CACHE_DIR where it was unset, as FLA's first call does
            return super().run(inputs)

    guard.run_backend_call(FirstUse(), materialize(CASE, CPU))
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    assert guard.take_breaches() == []

    class Moves(TorchChunk):
        name = "moves_inductor_cache"

        def run(self, inputs: KDAInputs) -> BackendOutput:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = "elsewhere"
            return super().run(inputs)

    before = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    guard.run_backend_call(Moves(), materialize(CASE, CPU))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == before
    (breach,) = guard.take_breaches()
    assert "changed the environment variable TORCHINDUCTOR_CACHE_DIR (put back)" in str(breach)


def test_a_changed_variable_is_put_back_without_its_value_in_the_message() -> None:
    os.environ["HOSTILE_TEST_TOKEN"] = "before-secret"

    class Changes(TorchChunk):
        name = "changes_a_variable"

        def run(self, inputs: KDAInputs) -> BackendOutput:
            os.environ["HOSTILE_TEST_TOKEN"] = "after-secret"
            return super().run(inputs)

    try:
        guard.run_backend_call(Changes(), materialize(CASE, CPU))
        assert os.environ["HOSTILE_TEST_TOKEN"] == "before-secret"
        (breach,) = guard.take_breaches()
        assert "changed the environment variable HOSTILE_TEST_TOKEN (put back)" in str(breach)
        assert "secret" not in str(breach) and breach.verdict == "fail"
    finally:
        os.environ.pop("HOSTILE_TEST_TOKEN", None)


class Noisy(TorchChunk):
    """Adds noise from torch's global generator: ``draws`` numbers of it."""

    name = "noisy"

    def __init__(self, draws: int = 1) -> None:
        super().__init__()
        self.draws = draws

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        noise = torch.rand(self.draws)[0]
        return dataclasses.replace(out, o=out.o + noise.to(out.o.dtype))


def test_the_global_generator_is_put_back_and_stepped_so_noise_stays_fresh() -> None:
    inputs = materialize(CASE, CPU)
    torch.manual_seed(1)
    first = guard.run_backend_call(Noisy(), inputs).o
    second = guard.run_backend_call(Noisy(), inputs).o
    assert not torch.equal(first, second)  # a repeat of a noisy backend still differs (the determinism check)
    after_one_draw = torch.get_rng_state()
    torch.manual_seed(1)
    guard.run_backend_call(Noisy(draws=1000), inputs)
    guard.run_backend_call(Noisy(draws=7), inputs)
    assert torch.equal(torch.get_rng_state(), after_one_draw)  # how much a backend drew reaches no one
    torch.manual_seed(1)
    state = torch.get_rng_state()
    guard.run_backend_call(TorchChunk(), inputs)
    assert torch.equal(torch.get_rng_state(), state)  # a call that draws nothing moves nothing
    assert guard.take_breaches() == []  # drawing is not a failure


@pytest.mark.parametrize("module", [reference_run, world])
def test_a_replaced_definition_is_put_back_and_named(module: object) -> None:
    """The reference, or the world's own put_back (which the guard holds as it was at import)."""
    name = "run_reference" if module is reference_run else "put_back"
    real = getattr(module, name)

    class Replaces(TorchChunk):
        name = "replaces_a_definition"

        def run(self, inputs: KDAInputs) -> BackendOutput:
            setattr(module, name, lambda *args, **kwargs: [])
            return super().run(inputs)

    guard.run_backend_call(Replaces(), materialize(CASE, CPU))
    assert getattr(module, name) is real
    (breach,) = guard.take_breaches()
    assert f"replaced the suite's {module.__name__}.{name} (put back)" in str(breach)


def test_a_truth_written_with_the_inputs_is_made_again_from_the_suites_inputs() -> None:
    truth = case_truth(CASE, CPU)
    exact = run_reference(truth.inputs, truth.reference_form)

    class Spoils(TorchChunk):
        name = "spoils_input_and_truth"

        def run(self, inputs: KDAInputs) -> BackendOutput:
            out = super().run(inputs)
            inputs.q.add_(1)  # the truth made again from these would be wrong: the inputs come back first
            for held in gc.get_objects():
                if isinstance(held, CaseTruth) and held.inputs is inputs:
                    held.reference.final_state.zero_()
                    held.budgets.clear()
            return out

    guard.run_backend_call(Spoils(), truth.inputs)
    reasons = [str(breach) for breach in guard.take_breaches()]
    assert any("wrote into its input q" in reason for reason in reasons), reasons
    assert any(f"changed the suite's float64 truth of case {CASE.id} (made again)" in r for r in reasons), reasons
    assert torch.equal(truth.reference.final_state, exact.final_state)
    assert torch.equal(truth.reference.o, exact.o) and truth.budgets


def test_a_truth_a_question_wrote_is_found_after_the_next_kernel_call_and_charged_to_it() -> None:
    """The truths are proved after a kernel's call, not after a question (half a run's calls): a truth a
    ``supports`` wrote is found after the call that follows, made again, and that call charged."""
    truth = case_truth(CASE, CPU)
    exact = run_reference(truth.inputs, truth.reference_form)

    class SpoilsInSupports(TorchChunk):
        name = "spoils_the_truth_in_supports"

        def supports(self, case: Case) -> Support:
            for held in gc.get_objects():
                if isinstance(held, CaseTruth) and held.case is case:
                    held.reference.o.zero_()
            return super().supports(case)

    backend = SpoilsInSupports()
    assert guard.supports(backend, truth.case) and guard.take_breaches() == []
    assert not torch.equal(truth.reference.o, exact.o)  # not proved after the question
    guard.run_backend_call(backend, truth.inputs)
    [breach] = guard.take_breaches()
    assert f"changed the suite's float64 truth of case {CASE.id} (made again)" in str(breach), str(breach)
    assert str(breach).startswith(backend.name) and torch.equal(truth.reference.o, exact.o)


def test_a_kept_truth_is_proved_when_taken_out_and_a_write_while_kept_is_said_and_charged_to_no_one() -> None:
    """A truth a cache keeps between cases is parked, not proved after every call (a run keeps up to 128): a
    write into it then is found when the truth is taken out again, made good and said, charged to no call;
    back in use, a write is found after the next call and charged to it as before."""
    from kda_conformance.running.truth_cache import TruthCache

    cache = TruthCache(CPU)
    truth = cache.get(CASE)
    exact = run_reference(truth.inputs, truth.reference_form)
    cache.trim()
    truth.reference.o.numpy().reshape(-1)[0] += 1.0  # a raw write while it is kept
    guard.run_backend_call(TorchChunk(), truth.inputs)
    assert guard.take_breaches() == [] and not torch.equal(truth.reference.o, exact.o)
    assert cache.get(CASE) is truth and torch.equal(truth.reference.o, exact.o)
    assert cache.take_spoiled() == [
        f"changed the suite's float64 truth of case {CASE.id} while it was kept between cases (made again; which "
        "call wrote it is not known)"
    ]
    assert cache.take_spoiled() == [] and cache.get(CASE) is truth and cache.take_spoiled() == []

    class Spoils(TorchChunk):
        name = "spoils_the_truth_in_use"

        def run(self, inputs: KDAInputs) -> BackendOutput:
            truth.reference.o.zero_()
            return super().run(inputs)

    guard.run_backend_call(Spoils(), truth.inputs)
    [breach] = guard.take_breaches()
    assert str(breach).startswith("spoils_the_truth_in_use changed the suite's float64 truth of case")
    assert torch.equal(truth.reference.o, exact.o)


def test_a_truth_is_proved_by_one_sum_over_one_buffer_and_a_raw_write_anywhere_in_it_is_found() -> None:
    """After every call every truth alive is proved: its tensors live in one buffer, summed once per proof (a
    sum per tensor of every cached truth was most of the controls' CPU time); a write no torch op sees (through
    numpy) into any of them is still found and made good, and a declared precision's truth shares the proof."""
    from kda_conformance.running import truth as truths
    from kda_kernels.protocol import WorkingPrecision

    case = Case(seq_lens=(20, 13), packed=True, initial_state="random", checkpoints=((0, 5),), head_k_dim=16)
    strict = case_truth(case, CPU)
    declared = truths.at_precision(strict, WorkingPrecision(dots="tf32", source="a test"))
    exact = run_reference(strict.inputs, strict.reference_form)
    seals = [seal for held, seal in truths._seals.values() if held() in (strict, declared)]
    assert len(seals) == 2 and all(len(seal.proved) == 1 for seal in seals)
    for name in truths.REFERENCE_TENSORS:
        assert torch.equal(getattr(strict.reference, name), getattr(exact, name)), name
        getattr(strict.reference, name).numpy().reshape(-1)[-1] += 1.0
        assert truths._prove_truths() == [f"changed the suite's float64 truth of case {case.id} (made again)"]
        assert torch.equal(getattr(strict.reference, name), getattr(exact, name)), name
    assert declared.reference is strict.reference and truths._prove_truths() == []
