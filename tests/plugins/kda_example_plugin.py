"""A minimal backend plugin, the one docs/plugins.md shows: the float64 reference, rounded to the input dtype.

Its errors are pure output rounding, so it passes every budget; the suite's tests
use it to exercise the plugin mechanism, the CLI and the pytest report quickly.
"""

from __future__ import annotations

import torch

from kda_kernels.api import Backend, BackendOutput, KDAInputs, Support, register, stored
from kda_reference.run import run_reference


class RoundedReference(Backend):
    name = "example_rounded_reference"
    description = "the float64 reference with its output rounded to the input dtype"

    def availability(self, device: torch.device) -> Support:
        return Support.yes()

    def run(self, inputs: KDAInputs) -> BackendOutput:
        truth, case = run_reference(inputs), inputs.case
        return BackendOutput(o=stored(case, "o", truth.o), final_state=stored(case, "final_state", truth.final_state))


register(RoundedReference.name, RoundedReference)


class PlantedNaN(RoundedReference):
    """A planted bug: NaN in the output at token 17 of the first sequence, head 0."""

    name = "example_planted_nan"
    description = "the rounded reference with one NaN planted in the output"

    def run(self, inputs: KDAInputs) -> BackendOutput:
        out = super().run(inputs)
        row, start, end = inputs.case.row_spans[0]
        if end - start > 17:
            out.o[row, start + 17, 0, 0] = float("nan")
        return out


register(PlantedNaN.name, PlantedNaN)
