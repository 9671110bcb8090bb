"""Where a backend's gradient of one packed sequence, run alone, is worst against float64, and how that compares
with the working-precision baseline and the output dtype's resolution there.

``python tests/gradient_probe.py CASE.json SEQUENCE [GRADIENT] [BACKEND]`` (gradient ``dg``, backend
``fla_chunk`` by default) prints one JSON line: the backend's and the baseline's error RMS over the sequence, at
the backend's worst element the float64 value, both errors and one ulp of the gradient's dtype at that value,
and the backend's rel-RMS there beside the limit the gradients check holds that sequence alone to.
On the CPU a Triton backend runs under the interpreter (set here), which FLA's kernels compute bit for bit as an
H100 did for the case this was written for (docs/results/2026-12-07.md, seventeenth session). A fresh process
per call: the interpreter is process-wide.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TRITON_INTERPRET", "1")


def main(path: str, sequence: int, gradient: str = "dg", backend_name: str = "fla_chunk") -> dict:
    import torch

    from kda_cases.case import Case
    from kda_cases.materialize import materialize
    from kda_conformance.checks._derived import alone_inputs
    from kda_conformance.judging.metrics import measure
    from kda_conformance.running.gradient_truth import (
        alone_sequences,
        by_tensor,
        gradient_truth,
        part_scale,
        upstream_gradients,
    )
    from kda_kernels import registry, triton_interpret
    from kda_kernels.torch_chunk import TorchChunk
    from kda_reference.gradients import kda_gradients

    triton_interpret.enable()
    case = Case.from_json(open(path).read())
    inputs = materialize(case, torch.device("cpu"))
    d_o, d_final = upstream_gradients(inputs)
    row, start, end = dict(alone_sequences(case))[sequence]
    alone = alone_inputs(inputs, sequence)
    upstream = (d_o[row : row + 1, start:end], d_final[sequence : sequence + 1])
    got = by_tensor(registry.get(backend_name).run_backward(alone, *upstream))[gradient]
    base = by_tensor(TorchChunk(64).run_backward(alone, *upstream))[gradient]
    want = by_tensor(kda_gradients(alone.q, alone.k, alone.v, alone.g, alone.beta, alone.options, *upstream))[gradient]
    error, base_error = got.double() - want, base.double() - want
    truth = gradient_truth(inputs)
    rel_rms = measure(gradient, got, want, part_scale(truth.reference, truth.scales, gradient)).errors.rel_rms
    limit = truth.sequence_budgets[sequence][gradient].rel_rms
    worst = int(error.abs().argmax())
    value = float(want.flatten()[worst])
    ulp = float(torch.tensor(abs(value), dtype=got.dtype).nextafter(torch.tensor(float("inf"), dtype=got.dtype)))
    ulp -= float(torch.tensor(abs(value), dtype=got.dtype))
    return {
        "gradient": gradient,
        "dtype": str(got.dtype).removeprefix("torch."),
        "error_rms": float(error.pow(2).mean().sqrt()),
        "baseline_error_rms": float(base_error.pow(2).mean().sqrt()),
        "value_rms": float(want.pow(2).mean().sqrt()),
        "worst_index": [int(i) for i in torch.unravel_index(torch.tensor(worst), error.shape)],
        "worst_value": value,
        "worst_error": float(error.flatten()[worst]),
        "baseline_error_there": float(base_error.flatten()[worst]),
        "ulp_there": ulp,
        "worst_share_of_rms": float(error.flatten()[worst] ** 2 / error.pow(2).sum()),
        "rel_rms": rel_rms,
        "rel_rms_limit": limit.value,
        "limit_set_by": limit.binding,
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])))
