"""A served case as a standalone pytest file (``kda-conformance repro --write-test``), and its pool plan.

The standalone test holds the inputs, the poisoned pool and output buffer, the
float64 truth and the limits in ``FILE`` with a ``.pt`` suffix beside it, and checks what the serving
checks check. For a backend that gives ``standalone_source()`` (FLA's, FlashKDA's and AITER's kernels) it
needs only torch and the backend's package, to attach to an upstream report; for any other it imports this
suite to run it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch

from kda_cases.case import Case
from kda_cases.files import atomic_write_text
from kda_cases.materialize import cu_seqlens_tensor
from kda_conformance.checks import serving_case
from kda_conformance.repro.standalone_finding import rel_rms_source
from kda_conformance.running.truth import case_truth, declared_precision
from kda_kernels import registry
from kda_kernels.protocol import Backend
from kda_kernels.serving import NULL_SLOT, build_pool, new_out, pad_slot_for, plan_pool

WORDS = {"o": "the output", "final_state": "the final states", "checkpoint_states": "the checkpoint states"}


def plan_lines(case: Case, backend: Backend) -> list[str]:
    plan, pad = plan_pool(case), pad_slot_for(backend, case)
    lines = [f"pool: {plan.num_slots} slots, slot {NULL_SLOT} the null block; {plan.padding} padding entries ({pad})"]
    lines += [
        f"  sequence {n} ({length} tokens) -> slot {s}"
        for n, (s, length) in enumerate(zip(plan.seq_slots, case.seq_lens, strict=True))
    ]
    lines += [f"  checkpoint {j} {case.checkpoints[j]} -> slot {s}" for j, s in enumerate(plan.checkpoint_slots)]
    spare = [s for s in plan.unnamed_slots if s != NULL_SLOT]
    lines.append(
        f"  spare (nobody's): {spare or 'none'}; output buffer {plan.out_rows} rows for {case.total_tokens} tokens"
    )
    return lines


def suite_imports(backend: Backend) -> str:
    """The imports of a file that runs ``backend`` through this suite, inside its test: it skips where the
    suite (or the plugin module that registers the backend, or a library it declares) is not importable."""
    lines = ['needs("kda_kernels")']
    module = registry.plugin_of(backend.name)
    if module:  # a plugin's backend: importing its module registers it
        lines.append(f"needs({module!r})")
    lines += [
        f"needs({library.module!r}, {library.source_variable!r})"
        if library.source_variable
        else f"needs({library.module!r})"
        for library in backend.libraries
        if library.module
    ]
    return "".join(f"    {line}\n" for line in lines)


def needs_source(backend: Backend) -> str:
    """``needs(module)`` of the written file: the module imported, or the test skipped naming the package that
    is really missing (the library a backend declares, the suite, the plugin module; or a module one of them
    imports, by its own name), with how to get it where the backend's declaration says."""
    known = {library.module: (library.name, library.install) for library in backend.libraries if library.module}
    known["kda_kernels"] = ("kda-conformance", "pip install kda-conformance, the suite that runs this backend")
    module = registry.plugin_of(backend.name)
    if module:
        known[module] = (module, f"the module that registers {backend.name}")
    return textwrap.dedent(
        f"""

        LIBRARIES = {known!r}


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
                    pytest.skip(f"needs {{name}}" + (f" ({{install}})" if install else ""))
                pytest.skip(f"needs {{missing}}, which {{name}} imports (pip install {{missing}})")
        """
    )


def where_it_runs_source(backend: Backend, device: torch.device) -> str:
    """``where_it_runs()`` of the written file: the device to run on, or a skip with the reason. A finding
    measured on a GPU needs one; a Triton kernel measured on the CPU ran in Triton's interpreter, which needs
    TRITON_INTERPRET=1 (and this suite's workarounds) set before Triton is imported."""
    if device.type != "cpu":
        need = f"needs a GPU (it was written on {device.type}, where the finding was measured); torch sees none"
        return textwrap.dedent(
            f"""

            def where_it_runs():
                if not torch.cuda.is_available():
                    pytest.skip({need!r})
                return "cuda"
            """
        )
    if backend.interpreted(device):
        need = (
            f"{backend.name}'s Triton kernels ran in Triton's CPU interpreter when this was written: set "
            "TRITON_INTERPRET=1 (kda_kernels.triton_interpret.enable() adds the workarounds) or run on a GPU"
        )
        return textwrap.dedent(
            f"""

            def where_it_runs():
                if torch.cuda.is_available():
                    return "cuda"
                if os.environ.get("TRITON_INTERPRET") != "1":
                    pytest.skip({need!r})
                return "cpu"
            """
        )
    return textwrap.dedent(
        """

        def where_it_runs():
            return "cuda" if torch.cuda.is_available() else "cpu"
        """
    )


def write_standalone(
    case: Case, backend: Backend, device: torch.device, poison: str, path: Path, check: str = "budget"
) -> tuple[Path, Path]:
    """Write ``path`` (a pytest file) and its data beside it: the poisoned served run of ``case``, named for
    ``check`` (the finding's check), holding every limit the suite judges on it: max-abs and rel-RMS of the
    output, the final states and the checkpoint states, at the backend's declared working precision."""
    served = serving_case(case, backend)
    declared = declared_precision(backend, device)
    truth = case_truth(served, device, precision=declared)
    plan = plan_pool(served)
    # The pool and buffer the serving harness starts from, built without calling the backend: a kernel that
    # crashes (a sticky device error) still gets its file.
    pool_before = build_pool(truth.inputs, plan, poison)
    out_before = new_out(served, plan, poison, truth.inputs.device)
    x = truth.inputs
    kwargs = {k: v for k, v in x.kernel_kwargs().items() if k not in ("initial_state", "cu_seqlens")}
    n, T = served.num_seqs, served.total_tokens
    data = {
        "case_json": served.to_json(),
        "backend": backend.name,
        "poison": poison,
        **{name: getattr(x, name).cpu() for name in ("q", "k", "v", "g", "beta")},
        "kwargs": {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()},
        "cu_seqlens": cu_seqlens_tensor(served, "cpu", plan.padding),
        "state_indices": torch.tensor(plan.state_indices(pad_slot_for(backend, served)), dtype=torch.int32),
        "has_initial_state": torch.tensor([served.has_initial_state] * n + [False] * plan.padding),
        "num_seqs": n,
        "tokens": T,
        "seq_slots": list(plan.seq_slots),
        "unnamed_slots": plan.unnamed_slots,
        "checkpoint_slots": list(plan.checkpoint_slots),
        "pool_before": pool_before.cpu(),
        "out_before": out_before.cpu(),
        "truth": {name: getattr(truth.reference, name).cpu() for name in truth.budgets},
        "limits": {
            name: {"max_abs": budget.max_abs.value, "rel_rms": budget.rel_rms.value}
            for name, budget in truth.budgets.items()
        },
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data_path = path.with_suffix(".pt")
    torch.save(data, data_path)
    source = backend.standalone_source(served) if backend.standalone_source is not None else None
    if source is None:
        source = (
            f"\n# {backend.name} gives no standalone call: this runs it through the kda-conformance suite.\n"
            "def serve_batch(d, pool, out):\n"
            + suite_imports(backend)
            + textwrap.indent(
                textwrap.dedent(
                    f"""\
                from kda_cases.case import Case
                from kda_cases.materialize import materialize
                from kda_kernels import registry
                from kda_kernels.serving import serve

                case = Case.from_json(d["case_json"])
                inputs = materialize(case, pool.device)
                slots, padding = tuple(d["seq_slots"]), len(d["state_indices"]) - d["num_seqs"]
                has_h0 = tuple(bool(x) for x in d["has_initial_state"][: d["num_seqs"]])
                checkpoints = tuple(d["checkpoint_slots"])
                serve(registry.get({backend.name!r}), inputs, pool, slots, has_h0, out, checkpoints, padding=padding)
                """
                ),
                "    ",
            )
        )
    else:
        source += textwrap.dedent(
            """

            def serve_batch(d, pool, out):
                # As vLLM's Triton path serves a kernel: fresh sequences start from zeros (their slot is never
                # read), padding entries (-1 or 0) are dropped, final states are scattered by slot.
                n = d["num_seqs"]
                slots = d["state_indices"][:n].long()
                resumed = d["has_initial_state"][:n]
                h0 = None
                if bool(resumed.any()):
                    h0 = torch.where(resumed.view(-1, 1, 1, 1), pool[slots], torch.zeros_like(pool[slots])).float()
                o, final = call(d["q"], d["k"], d["v"], d["g"], d["beta"], h0, d["cu_seqlens"][: n + 1], **d["kwargs"])
                out[:, : d["tokens"]] = o
                pool[slots] = final.to(pool.dtype)
            """
        )
    body = textwrap.dedent(
        f"""
        DATA = Path(__file__).with_name({data_path.name!r})


        INTS = {{1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}}


        TINY = torch.finfo(torch.float64).tiny
        WORDS = {{"o": "output", "final_state": "final states", "checkpoint_states": "checkpoint states"}}
        METRICS = {{"max_abs": "max-abs", "rel_rms": "rel-RMS"}}


        def bits(x):
            return x.contiguous().view(INTS[x.element_size()])


        def test_{case.id.replace("-", "_")}_{backend.name}_{check}():
            device = where_it_runs()
            d = torch.load(DATA, weights_only=True)  # tensors and plain values only: a tampered file runs no code
            d = {{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in d.items()}}
            d["kwargs"] = {{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in d["kwargs"].items()}}
            d["truth"] = {{k: v.to(device) for k, v in d["truth"].items()}}
            pool, out, T = d["pool_before"].clone(), d["out_before"].clone(), d["tokens"]
            serve_batch(d, pool, out)
            problems = []
            for slot in d["unnamed_slots"]:
                if not torch.equal(bits(pool[slot]), bits(d["pool_before"][slot])):
                    problems.append(f"slot {{slot}} written: no sequence names it (slot 0 is the null block)")
            if not torch.equal(bits(out[:, T:]), bits(d["out_before"][:, T:])):
                problems.append("output rows past the last token written")
            got = {{"o": out[:, :T], "final_state": pool[d["seq_slots"]]}}
            got["checkpoint_states"] = pool[d["checkpoint_slots"]]
            for name, limits in d["limits"].items():
                want = d["truth"][name]
                err = (got[name].double() - want).abs()
                finite = bool(err.isfinite().all())
                measured = {{
                    "max_abs": float(err.max()) if finite else math.inf,
                    "rel_rms": rms_past_one_ulp(err, want, got[name].dtype)
                    / float(want.pow(2).mean().sqrt().clamp_min(TINY))
                    if finite
                    else math.inf,
                }}
                for metric, limit in limits.items():
                    if not measured[metric] <= limit:
                        problem = f"{{WORDS[name]}}: {{METRICS[metric]}} {{measured[metric]:.3e}} > limit {{limit:.3e}}"
                        problem += f" ({{measured[metric] / limit:.3g}}x)" if limit > 0 else ""
                        if metric == "max_abs":
                            where = (err > limits["max_abs"]).logical_or(~err.isfinite()).nonzero()[0].tolist()
                            problem += f", first at {{tuple(where)}}"
                        problems.append(problem)
            assert not problems, "\\n".join(problems)
        """
    )
    # The finding names its case (the test function takes its id); the file holds it as the server is handed it.
    as_served = f" (the finding's {case.id}, as served)" if served.id != case.id else ""
    precision = f" at its declared working precision ({declared.label})" if declared is not None else ""
    header = (
        f'"""Standalone repro written by `kda-conformance`: check {check}, case {served.id}{as_served}, on '
        f"{backend.name}.\n\n"
        f"The case is served as a server serves it (packed, states in a pool poisoned with {poison}, the output "
        "written into a poisoned buffer) and held to every limit the suite judges on it: max-abs and rel-RMS of "
        f"{', '.join(WORDS[name] for name in truth.budgets)}{precision}; memory no sequence names must come "
        f"back bitwise unchanged.\n\nCase: {served.to_json()}\nData: {data_path.name} (inputs, the poisoned pool "
        "and output buffer, the float64 truth, the limits).\nIt skips, saying why, where its library or the "
        'device it needs is missing.\n"""\n\nimport importlib\nimport math\nimport os\nfrom pathlib import Path\n\n'
        "import pytest\nimport torch\n"
    )
    text = header + needs_source(backend) + source + "\n" + where_it_runs_source(backend, device)
    text += "\n\n" + rel_rms_source() + body
    atomic_write_text(path, text)
    return path, data_path
