"""Correct backends but for one behaviour each, for the tests of the checks that see what servers do
(tests/test_serving_patterns.py): host metadata trusted or checked, garbage past the tokens, variance
within a chunk, a tiny leak from beyond a chunk, nondeterminism. A module of its own, so that a process
spawned for a probe can import them."""

from __future__ import annotations

import dataclasses

import torch

from kda_cases.dtypes import INT_OF_SIZE
from kda_cases.envelope import Envelope
from kda_cases.materialize import KDAInputs
from kda_kernels.protocol import BackendOutput
from kda_kernels.registry import register
from kda_kernels.torch_chunk import TorchChunk


class TakesHostBounds(TorchChunk):
    """Takes ``cu_seqlens_cpu`` and trusts it over the device's bounds, as a kernel that skips the sync."""

    name = "test_takes_host_bounds"
    envelope = Envelope(host_metadata=("cu_seqlens_cpu",))

    def host_metadata(self, device: torch.device, cu_seqlens_cpu: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"cu_seqlens_cpu": cu_seqlens_cpu}

    def run(self, inputs: KDAInputs) -> BackendOutput:
        host = (inputs.host_metadata or {}).get("cu_seqlens_cpu")
        if host is not None:
            inputs = dataclasses.replace(inputs, cu_seqlens=host.to(inputs.device), host_metadata=None)
        return super().run(inputs)


class ChecksHostBounds(TakesHostBounds):
    name = "test_checks_host_bounds"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        host = (inputs.host_metadata or {}).get("cu_seqlens_cpu")
        if host is not None and not torch.equal(host, inputs.cu_seqlens.cpu().to(host.dtype)):
            raise ValueError("cu_seqlens_cpu does not match cu_seqlens")
        return super().run(inputs)


class WrongWhenDerived(TakesHostBounds):
    """Right with the host's bounds, off by 0.5 when it derives them itself (a zero-length member's chunk
    numbering gone wrong, say); ``wrong_with_host``: the other way round (a table read one row off)."""

    name = "test_wrong_when_derived"
    wrong_with_host = False

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        if (inputs.host_metadata is not None) == self.wrong_with_host:
            out = dataclasses.replace(out, o=out.o + 0.5)
        return out


class FarWrongWhenDerived(TakesHostBounds):
    """Off by 5e-3 with the host's bounds (a precision loss of its own) and by 0.5 when it derives them: the
    difference is still the derived result's."""

    name = "test_far_wrong_when_derived"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        return dataclasses.replace(out, o=out.o + (5e-3 if inputs.host_metadata is not None else 0.5))


class WrongWhenPassed(WrongWhenDerived):
    name = "test_wrong_when_passed"
    wrong_with_host = True


class GarbageTail(TorchChunk):
    name = "test_garbage_tail"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        o = out.o.clone()
        o[:, inputs.case.total_tokens :] = float("nan")  # torch.empty's rows, from an API that allocates o
        return dataclasses.replace(out, o=o)


class CallerBufferTail(GarbageTail):
    """Writes into the caller's buffer (filled with NaN by the suite) and leaves the rows past the tokens as
    they were, as FlashKDA's ``out`` and vLLM's ``out=`` slice."""

    name = "test_caller_buffer_tail"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        return dataclasses.replace(super().run(inputs), o_in_caller_buffer=True)


class NotBatchInvariant(TorchChunk):
    """Outputs of a 64-token chunk move by a hair with a later token of the same chunk."""

    name = "test_not_batch_invariant"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        o = out.o.clone()
        T = o.shape[1]
        for start in range(0, T, 64):
            end = min(T, start + 64)
            o[:, start : end - 1] += (1e-7 * inputs.v[:, end - 1 : end]).to(o.dtype)
        return dataclasses.replace(out, o=o)


class TinyFarLeak(TorchChunk):
    """Outputs move by a hair with the token 64 places later: from beyond their own chunk, but within the limit,
    where the prefix check cannot tell it from rounding (a warning)."""

    name = "test_tiny_far_leak"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        o = out.o.clone()
        o[:, :-64] += (1e-7 * inputs.v[:, 64:]).to(o.dtype)
        return dataclasses.replace(out, o=o)


class Nondeterministic(TorchChunk):
    """Every other call moves one output by its last bit, like an atomic reduction's order: within the
    budget."""

    name = "test_nondeterministic"
    calls = 0

    def run(self, inputs: KDAInputs) -> BackendOutput:
        return self.varied(super().run(inputs))

    @staticmethod
    def varied(out: BackendOutput) -> BackendOutput:
        Nondeterministic.calls += 1
        o = out.o.clone()
        o.view(INT_OF_SIZE[o.element_size()])[0, 0, 0, 0] ^= Nondeterministic.calls % 2
        return dataclasses.replace(out, o=o)


class NondeterministicLeak(TorchChunk):
    """Varies by itself (as above) and lets later tokens reach earlier outputs far past the limit."""

    name = "test_nondeterministic_leak"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        o = out.o.float()
        o[:, :-64] += 0.05 * inputs.v[:, 64:].float()
        return Nondeterministic.varied(dataclasses.replace(out, o=o.to(out.o.dtype)))


class StateBetweenCalls(TorchChunk):
    """Right on its first call; later calls add what the previous one left behind (a buffer it keeps and
    never resets): each repeat far outside the budget."""

    name = "test_state_between_calls"

    def __init__(self) -> None:
        super().__init__()
        self.left: float = 0.0

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        o = (out.o.float() + self.left).to(out.o.dtype)
        self.left = 0.05
        return dataclasses.replace(out, o=o)


class WrongOnce(TorchChunk):
    """Off by 0.5 on its first call in a process, right from then on (garbage in a buffer its first launch
    reads, as a kernel whose wrong answer does not repeat): Hypothesis's replay of the failing example passes."""

    name = "test_wrong_once"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        self.calls += 1
        return dataclasses.replace(out, o=out.o + 0.5) if self.calls == 1 else out


class DriftingError(TorchChunk):
    """The baseline's error times ``KDA_TEST_ERROR_SCALE`` (default 1): a kernel whose error grew 1.4 times
    still passes the budget rule (its factors are 4 and 2), which only the sentinels' trends see."""

    name = "test_drifting_error"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        import os

        from kda_reference.run import run_reference

        scale = float(os.environ.get("KDA_TEST_ERROR_SCALE", "1"))
        out, truth = super().run(inputs), run_reference(inputs)

        def scaled(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
            return (want + scale * (got.double() - want)).to(got.dtype)

        return dataclasses.replace(
            out,
            o=scaled(out.o, truth.o),
            final_state=scaled(out.final_state, truth.final_state),
            checkpoint_states=None,
        )


for backend in (
    TakesHostBounds,
    ChecksHostBounds,
    WrongWhenDerived,
    FarWrongWhenDerived,
    WrongWhenPassed,
    GarbageTail,
    CallerBufferTail,
    NotBatchInvariant,
    TinyFarLeak,
    Nondeterministic,
    NondeterministicLeak,
    StateBetweenCalls,
    WrongOnce,
    DriftingError,
):
    register(backend.name, backend, replace=True)
