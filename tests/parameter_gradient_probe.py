"""How far a backend's gradients of the gate's parameters (dA_log, ddt_bias) are from float64, beside the
working-precision baseline's and the backend's own on the same values in float32.

``python tests/parameter_gradient_probe.py CASE_JSON [BACKEND [DEVICE]]`` (backend ``fla_chunk``, device ``cpu``
by default; ``cuda`` on a GPU) prints one JSON line: for dg, dA_log and ddt_bias, the backend's and the baseline's
(chunk 64) max-abs error and rel-RMS (against the scale the gradients check takes, for the parameters the norm of
the terms they sum), the limits the check holds them to and what set each; then the backend's max-abs error of
dA_log when the case's half-precision inputs are handed to it as float32 of the same values (the same float64
truth), where its intermediates are float32 too. A half-precision case whose error falls by orders of magnitude
there owes it to what the backend keeps at half precision, not to its algorithm. On the CPU a Triton backend runs
under the interpreter (set here; its dots are float32, not an NVIDIA GPU's TF32). A fresh process per call: the
interpreter is process-wide.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
PARAMETERS = ("dg", "dA_log", "ddt_bias")


def main(case_json: str, backend_name: str = "fla_chunk", device_name: str = "cpu") -> dict:
    if device_name == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from kda_cases.case import Case
    from kda_cases.materialize import materialize
    from kda_conformance.judging.metrics import measure
    from kda_conformance.running.gradient_truth import by_tensor, gradient_truth
    from kda_kernels import registry, triton_interpret
    from kda_kernels.torch_chunk import TorchChunk

    device = torch.device(device_name)
    if device.type == "cpu":
        triton_interpret.enable()
    case = Case.from_json(case_json)
    if not case.gate_in_kernel:
        raise SystemExit(f"case {case.id} computes its gate outside the kernel: it has no dA_log or ddt_bias")
    inputs = materialize(case, device)
    truth = gradient_truth(inputs)
    backend = registry.get(backend_name)
    got = by_tensor(backend.run_backward(inputs, truth.d_o, truth.d_final))
    base = by_tensor(TorchChunk(64).run_backward(inputs, truth.d_o, truth.d_final))
    said: dict = {"case": case.id, "backend": backend_name, "device": str(device)}
    for name in (n for n in PARAMETERS if n in truth.reference):
        scale = truth.scales.get(name, (0.0, 0.0))[1]
        ours, baseline = (measure(name, x[name], truth.reference[name], scale).errors for x in (got, base))
        budget = truth.budgets[name]
        said[name] = {
            "max_abs": ours.max_abs,
            "baseline_max_abs": baseline.max_abs,
            "max_abs_limit": budget.max_abs.value,
            "max_abs_set_by": budget.max_abs.binding,
            "rel_rms": ours.rel_rms,
            "baseline_rel_rms": baseline.rel_rms,
            "rel_rms_limit": budget.rel_rms.value,
            "rel_rms_set_by": budget.rel_rms.binding,
            "scale": scale,
        }
    if case.dtype != "fp32":

        def widened(x: torch.Tensor | None) -> torch.Tensor | None:
            return x.float() if x is not None and x.dtype in (torch.bfloat16, torch.float16) else x

        same_values = dataclasses.replace(
            inputs,
            case=case.replace(dtype="fp32"),
            **{n: widened(getattr(inputs, n)) for n in ("q", "k", "v", "g", "beta")},
        )
        wide = by_tensor(backend.run_backward(same_values, truth.d_o.float(), truth.d_final))["dA_log"]
        said["dA_log"]["max_abs_on_float32_of_the_same_values"] = float(
            (wide.double() - truth.reference["dA_log"]).abs().max()
        )
    return said


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
