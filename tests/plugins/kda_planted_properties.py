"""Planted bugs that only the metamorphic properties see, each a small wrapper around the torch_chunk baseline.

Loaded with ``--kda-plugin kda_planted_properties`` by tests/test_properties_catch_bugs.py.
"""

from __future__ import annotations

import dataclasses

from kda_cases.materialize import KDAInputs
from kda_kernels.protocol import BackendOutput
from kda_kernels.registry import register
from kda_kernels.torch_chunk import TorchChunk


class FutureLeak(TorchChunk):
    """Each output also sees a trace of the next token's value (future-token leakage, FLA #1240)."""

    name = "planted_future_leak"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        o = out.o.clone()
        o[:, :-1] += (1e-6 * inputs.v[:, 1:]).to(o.dtype)
        return dataclasses.replace(out, o=o)


class PackedStateLeak(TorchChunk):
    """Runs a packed batch as one long sequence: each sequence starts from the previous one's state."""

    name = "planted_packed_state_leak"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        if inputs.cu_seqlens is None:
            return super().run(inputs)
        case = inputs.case
        whole = case.replace(seq_lens=(case.total_tokens,), packed=False, checkpoints=())
        h0 = None if inputs.initial_state is None else inputs.initial_state[:1]
        out = super().run(dataclasses.replace(inputs, case=whole, cu_seqlens=None, initial_state=h0))
        final = out.final_state.expand(case.num_seqs, *out.final_state.shape[1:]).contiguous()
        return BackendOutput(o=out.o, final_state=final)


class IgnoresInitialState(TorchChunk):
    """Drops the initial state (a resumed request starts from zeros: the stale/cold-slot family)."""

    name = "planted_ignores_initial_state"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        return super().run(dataclasses.replace(inputs, initial_state=None))


for backend in (FutureLeak, PackedStateLeak, IgnoresInitialState):
    register(backend.name, backend)
