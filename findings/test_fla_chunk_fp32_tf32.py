"""Standalone repro written by `kda-conformance`: check budget, case kda-a06a04918494, on fla_chunk.

The case is served as a server serves it (packed, states in a pool poisoned with nan, the output written into a poisoned buffer) and held to every limit the suite judges on it: max-abs and rel-RMS of the output, the final states; memory no sequence names must come back bitwise unchanged.

Case: {"beta_regime": "typical", "beta_sigmoid_in_kernel": true, "checkpoints": [], "dtype": "fp32", "gate": "lower_bound", "gate_regime": "typical", "head_k_dim": 64, "head_v_dim": 64, "initial_state": "none", "key_regime": "random", "key_rho": 0.0, "l2norm_in_kernel": true, "lower_bound": -5.0, "num_heads": 2, "num_v_heads": 2, "packed": true, "safe_gate": true, "scale": null, "seed": 0, "seq_lens": [37], "state_dtype": "fp32", "state_layout": "k_first", "tags": []}
Data: test_fla_chunk_fp32_tf32.pt (inputs, the poisoned pool and output buffer, the float64 truth, the limits).
It skips, saying why, where its library or the device it needs is missing.
"""

import importlib
import math
import os
from pathlib import Path

import pytest
import torch


LIBRARIES = {'fla': ('fla-core', 'pip install fla-core==0.6.0'), 'kda_kernels': ('kda-conformance', 'pip install kda-conformance, the suite that runs this backend')}


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


def call(q, k, v, g, beta, initial_state, cu_seqlens, **kwargs):
    os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "1"  # the Triton path itself, not a dispatch to FlashKDA
    kda = needs("fla.ops.kda")  # skips naming what is missing: fla-core, or a module it imports
    return kda.chunk_kda(
        q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, output_final_state=True, safe_gate=True, chunk_size=64, **kwargs
    )


def serve_batch(d, pool, out):
    # As vLLM's Triton path serves a kernel: fresh sequences start from zeros (their slot is never
    # read), padding entries (-1) are dropped, final states are scattered by slot.
    n = d["num_seqs"]
    slots = d["state_indices"][:n].long()
    resumed = d["has_initial_state"][:n]
    h0 = None
    if bool(resumed.any()):
        h0 = torch.where(resumed.view(-1, 1, 1, 1), pool[slots], torch.zeros_like(pool[slots])).float()
    o, final = call(d["q"], d["k"], d["v"], d["g"], d["beta"], h0, d["cu_seqlens"][: n + 1], **d["kwargs"])
    out[:, : d["tokens"]] = o
    pool[slots] = final.to(pool.dtype)



def where_it_runs():
    if not torch.cuda.is_available():
        pytest.skip('needs a GPU (it was written on cuda, where the finding was measured); torch sees none')
    return "cuda"

DATA = Path(__file__).with_name('test_fla_chunk_fp32_tf32.pt')


INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


TINY = torch.finfo(torch.float64).tiny
WORDS = {"o": "output", "final_state": "final states", "checkpoint_states": "checkpoint states"}
METRICS = {"max_abs": "max-abs", "rel_rms": "rel-RMS"}


def bits(x):
    return x.contiguous().view(INTS[x.element_size()])


def test_kda_e96a2e820fe8_fla_chunk_budget():
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
