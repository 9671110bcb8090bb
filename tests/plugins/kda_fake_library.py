"""A backend over a small installed KDA library (tests/doubles/fake_kda, on PYTHONPATH), for the tests of the
standalone repros that ``kda-conformance findings --write-tests`` writes (tests/test_standalone_findings.py):
its library is declared, with a tolerance of its own tests, it gives the standalone call a repro file makes
with that library alone, and it declares the library's backward pass (autograd through its loop)."""

from __future__ import annotations

import importlib.util

import torch

from kda_kernels.api import (
    Backend,
    BackendOutput,
    Case,
    Envelope,
    Gradients,
    KDAInputs,
    Library,
    LibraryTolerance,
    Support,
    autograd_backward,
    register,
    stored,
)

FAKE_KDA = Library(
    "fake-kda",
    "fake-kda",
    module="fake_kda",
    install="the suite's tests/doubles/fake_kda, on PYTHONPATH",
    tolerance=LibraryTolerance(0.005, ("o", "final_state"), "fake_kda's own tests (a test double)"),
)

STANDALONE = """

def call(q, k, v, g, beta, initial_state, cu_seqlens, **kwargs):
    fake_kda = needs("fake_kda")  # skips naming fake-kda where it is missing
    return fake_kda.chunk_kda(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, **kwargs)
"""


class FakeKdaChunk(Backend):
    name = "fake_kda_chunk"
    description = "fake_kda.chunk_kda, a float32 token loop whose zero-length members shift later states"
    libraries = (FAKE_KDA,)
    family = "fake-kda loop"
    envelope = Envelope(backward=True)

    def availability(self, device: torch.device) -> Support:
        if importlib.util.find_spec("fake_kda") is None:
            return Support.no("fake_kda is not importable (put the suite's tests/doubles on PYTHONPATH)")
        return Support.yes()

    def standalone_source(self, case: Case) -> str:
        return STANDALONE

    def run(self, inputs: KDAInputs) -> BackendOutput:
        import fake_kda

        kwargs = inputs.kernel_kwargs()
        h0 = kwargs.pop("initial_state")
        kwargs["initial_state"] = None if h0 is None else h0.float()
        o, final = fake_kda.chunk_kda(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, **kwargs)
        case = inputs.case
        return BackendOutput(o=stored(case, "o", o), final_state=stored(case, "final_state", final))

    def run_backward(self, inputs: KDAInputs, d_o: torch.Tensor, d_final: torch.Tensor | None) -> Gradients:
        import fake_kda

        return autograd_backward(inputs, d_o, d_final, fake_kda.chunk_kda, inputs.kernel_kwargs())


class FakeKdaSticky(FakeKdaChunk):
    """The same library where the suite calls it, raising CUDA's sticky error: a rerun that loses the device."""

    name = "fake_kda_sticky"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


register(FakeKdaChunk.name, FakeKdaChunk)
register(FakeKdaSticky.name, FakeKdaSticky)
