"""Standalone repro written by `kda-conformance`: check budget, case kda-389366505a83 (the finding's kda-b97945225537, as served), on sglang_chunk.

The case is served as a server serves it (packed, states in a pool poisoned with nan, the output written into a poisoned buffer) and held to every limit the suite judges on it: max-abs and rel-RMS of the output, the final states; memory no sequence names must come back bitwise unchanged.

Case: {"beta_regime": "typical", "beta_sigmoid_in_kernel": true, "checkpoints": [], "dtype": "bf16", "gate": "softplus", "gate_regime": "reset", "head_k_dim": 32, "head_v_dim": 64, "initial_state": "large", "key_regime": "random", "key_rho": 0.0, "l2norm_in_kernel": false, "lower_bound": null, "num_heads": 1, "num_v_heads": 1, "packed": true, "safe_gate": false, "scale": null, "seed": 3859, "seq_lens": [572, 572, 572], "state_dtype": "bf16", "state_layout": "v_first", "tags": ["profile:nightly"]}
Data: test_sglang_unsafe_gate_fused_diagonal.pt (inputs, the poisoned pool and output buffer, the float64 truth, the limits).
It skips, saying why, where its library or the device it needs is missing.
"""

import importlib
import math
import os
from pathlib import Path

import pytest
import torch


LIBRARIES = {'kda_kernels': ('kda-conformance', 'pip install kda-conformance, the suite that runs this backend')}


def needs(module, source_variable=None):
    if source_variable and os.environ.get(source_variable):
        return None  # the suite loads it from the source tree that variable names
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = (exc.name or module).split(".")[0]
        top = module.split(".")[0]
        name, install = LIBRARIES.get(top, (top, ""))
        if missing == top:
            pytest.skip(f"needs {name}" + (f" ({install})" if install else ""))
        pytest.skip(f"needs {missing}, which {name} imports (pip install {missing})")

# sglang_chunk gives no standalone call: this runs it through the kda-conformance suite.
def serve_batch(d, pool, out):
    needs("kda_kernels")
    from kda_cases.case import Case
    from kda_cases.materialize import materialize
    from kda_kernels import registry
    from kda_kernels.serving import serve

    case = Case.from_json(d["case_json"])
    inputs = materialize(case, pool.device)
    slots, padding = tuple(d["seq_slots"]), len(d["state_indices"]) - d["num_seqs"]
    has_h0 = tuple(bool(x) for x in d["has_initial_state"][: d["num_seqs"]])
    checkpoints = tuple(d["checkpoint_slots"])
    serve(registry.get('sglang_chunk'), inputs, pool, slots, has_h0, out, checkpoints, padding=padding)



def where_it_runs():
    if not torch.cuda.is_available():
        pytest.skip('needs a GPU (it was written on cuda, where the finding was measured); torch sees none')
    return "cuda"

DATA = Path(__file__).with_name('test_sglang_unsafe_gate_fused_diagonal.pt')


INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


TINY = torch.finfo(torch.float64).tiny
WORDS = {"o": "output", "final_state": "final states", "checkpoint_states": "checkpoint states"}
METRICS = {"max_abs": "max-abs", "rel_rms": "rel-RMS"}


def bits(x):
    return x.contiguous().view(INTS[x.element_size()])


def test_kda_b97945225537_sglang_chunk_budget():
    device = where_it_runs()
    d = torch.load(DATA, weights_only=True)  # tensors and plain values only: a tampered file runs no code
    d = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in d.items()}
    d["kwargs"] = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in d["kwargs"].items()}
    d["truth"] = {k: v.to(device) for k, v in d["truth"].items()}
    pool, out, T = d["pool_before"].clone(), d["out_before"].clone(), d["tokens"]
    serve_batch(d, pool, out)
    problems = []
    for slot in d["unnamed_slots"]:
        if not torch.equal(bits(pool[slot]), bits(d["pool_before"][slot])):
            problems.append(f"slot {slot} written: no sequence names it (slot 0 is the null block)")
    if not torch.equal(bits(out[:, T:]), bits(d["out_before"][:, T:])):
        problems.append("output rows past the last token written")
    got = {"o": out[:, :T], "final_state": pool[d["seq_slots"]]}
    got["checkpoint_states"] = pool[d["checkpoint_slots"]]
    for name, limits in d["limits"].items():
        want = d["truth"][name]
        err = (got[name].double() - want).abs()
        finite = bool(err.isfinite().all())
        measured = {
            "max_abs": float(err.max()) if finite else math.inf,
            "rel_rms": float(err.pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp_min(TINY))
            if finite
            else math.inf,
        }
        for metric, limit in limits.items():
            if not measured[metric] <= limit:
                problem = f"{WORDS[name]}: {METRICS[metric]} {measured[metric]:.3e} > limit {limit:.3e}"
                problem += f" ({measured[metric] / limit:.3g}x)" if limit > 0 else ""
                if metric == "max_abs":
                    where = (err > limits["max_abs"]).logical_or(~err.isfinite()).nonzero()[0].tolist()
                    problem += f", first at {tuple(where)}"
                problems.append(problem)
    assert not problems, "\n".join(problems)
