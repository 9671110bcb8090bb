"""A finding as a pytest file a kernel's maintainer runs with torch, their own package and pytest, and nothing of
this suite (``kda-conformance findings --write-tests``), and as the text of an upstream issue
(``kda-conformance findings --report ID``).

The file calls the kernel's public entry point as the server's layer calls it (``Backend.standalone_source``),
draws the finding's inputs from the case's seed with the suite's own drawing code (``kda_cases/seeded.py``,
written into the file verbatim, so the bits are the ones the suite judged), computes the float64 truth with
a plain token loop (``kda_reference/preprocess.py`` and ``plain.py``, verbatim), and holds the kernel's output
and final states to the limits the suite judged them by, written as numbers with the terms they came from,
beside the tolerance the library's own tests assert. Its docstring says what goes wrong, where it was measured
and with which versions, what was measured there, and where the problem is tracked upstream. A data file is
never needed: every input is drawn from the seed.
"""

from __future__ import annotations

import inspect
import math
import textwrap
from pathlib import Path
from types import ModuleType

from kda_cases import seeded
from kda_cases.case import Case
from kda_cases.dtypes import GRADIENT_TENSORS
from kda_cases.files import atomic_write_text
from kda_cases.materialize import materialize
from kda_conformance.checks import offsets_past_2_31 as offsets
from kda_conformance.checks.gradients import WHOLE_BACKWARD
from kda_conformance.judging import metrics
from kda_conformance.running.gradient_truth import by_tensor, gate_gradient_terms, term_scales, upstream_gradients
from kda_kernels import serving
from kda_kernels.protocol import Backend
from kda_reference import plain, preprocess
from kda_reference.gradients import kda_gradients

# The suite's own modules a file carries, in order: each imports nothing of the suite but the ones before it.
EMBEDDED: tuple[ModuleType, ...] = (seeded, preprocess, plain)
# The tensors a direct call returns (a checkpoint state is a serving harness's, not the call's).
CALLED = ("o", "final_state")
SUITE_PACKAGES = ("kda_cases", "kda_reference", "kda_kernels", "kda_reports", "kda_conformance")
# The case's derived values the drawing code reads as attributes (cases/seeded.py).
DERIVED = ("row_spans", "offsets", "total_tokens", "num_seqs", "gate_in_kernel", "has_initial_state", "state_v_first")


def embedded_source(modules: tuple[ModuleType, ...] = EMBEDDED) -> str:
    """The drawing code and the float64 truth (or other ``modules`` of the suite that import nothing of it),
    verbatim, without their imports of each other."""
    parts = []
    for module in modules:
        lines = [
            line
            for line in inspect.getsource(module).splitlines()
            if not line.startswith(("from __future__", "from kda_", "import kda_"))
        ]
        name = module.__name__.replace("kda_", "", 1).replace(".", "/")
        parts.append(f"# ---- kda-conformance {name}.py, verbatim " + "-" * 40 + "\n" + "\n".join(lines).strip())
    return "\n\n\n".join(parts) + "\n"


def poisoned_memory_source() -> str:
    """The suite's poisoned scratch (kernels/serving.py), verbatim: inside it ``torch.empty`` returns NaN and, on
    CUDA, the caching allocator hands out blocks filled with the poison. A finding whose kernel gave non-finite
    values runs its call inside it, so a read of memory the kernel did not write shows as it did in the suite's
    process: on an H100 AITER's zero-length file, run alone in a fresh process (fresh, zeroed device memory),
    gave finite wrong values where the suite had measured inf."""
    functions = "\n\n".join(inspect.getsource(f) for f in (serving.poisoned_scratch, serving._prefill_allocator))
    head = f"# ---- kda-conformance kernels/serving.py, verbatim {'-' * 40}"
    return f"{head}\nSENTINEL = {serving.SENTINEL!r}\n\n\n{functions}"


def rel_rms_source() -> str:
    """The suite's rel-RMS numerator (judging/metrics.py ``rms_past_one_ulp``), verbatim: a file measures the
    rel-RMS its limit was set for, the largest error counted less one ulp."""
    head = f"# ---- kda-conformance judging/metrics.py, verbatim {'-' * 40}"
    return f"{head}\n{inspect.getsource(metrics.rms_past_one_ulp)}"


def case_spec_source(case: Case) -> str:
    """``CASE``: the case's fields and the values the drawing code derives from them, as plain Python."""
    fields = case.to_dict()
    fields.pop("tags", None)
    derived = {name: getattr(case, name) for name in DERIVED}
    shown = ",\n".join(f"    {name}={value!r}" for name, value in {**fields, **derived}.items())
    return f"CASE = SimpleNamespace(\n{shown},\n)\n"


def _call_kwargs(case: Case) -> str:
    """chunk_kda's keyword arguments of the case (the ones every KDA prefill entry point takes)."""
    return textwrap.dedent(
        f"""\
        dict(
            scale={case.scale!r},
            use_qk_l2norm_in_kernel={case.l2norm_in_kernel!r},
            use_beta_sigmoid_in_kernel={case.beta_sigmoid_in_kernel!r},
            use_gate_in_kernel={case.gate_in_kernel!r},
            A_log=x["A_log"],
            dt_bias=x["dt_bias"],
            lower_bound={case.lower_bound!r},
            state_v_first={case.state_v_first!r},
        )"""
    )


def _needs_source(backend: Backend) -> str:
    libraries = {
        library.module.split(".")[0]: (library.name, library.install, library.source_variable)
        for library in backend.libraries
        if library.module
    }
    return textwrap.dedent(
        f'''
        LIBRARIES = {libraries!r}


        def needs(module, source_variable=None):
            """``module`` imported, or the test skipped naming the package that is missing. A source tree named
            by ``source_variable`` is put first on the path."""
            top = module.split(".")[0]
            name, install, variable = LIBRARIES.get(top, (top, "", ""))
            tree = os.environ.get(source_variable or variable or "")
            if tree and tree not in sys.path:
                sys.path.insert(0, tree)
            try:
                return importlib.import_module(module)
            except ImportError as exc:
                missing = (exc.name or module).split(".")[0]
                if missing == top:
                    pytest.skip(f"needs {{name}}" + (f" ({{install}})" if install else ""))
                pytest.skip(f"needs {{missing}}, which {{name}} imports (pip install {{missing}})")
        '''
    )


def _where_it_runs_source(device_type: str, where: str) -> str:
    if device_type == "cpu":
        body = 'return "cuda" if torch.cuda.is_available() else "cpu"'
    else:
        reason = f"needs a GPU (the finding was measured on {where}); torch sees none"
        body = f'if not torch.cuda.is_available():\n        pytest.skip({reason!r})\n    return "cuda"'
    return f"\n\ndef where_it_runs():\n    {body}\n"


def _literal(value: object) -> str:
    """``value`` as Python source that evaluates back to it: its repr, but a non-finite float spelled
    ``float('inf')`` (repr writes ``inf`` and ``nan``, names the file does not define: a finding whose output
    was non-finite got a file that failed to import)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        items = ", ".join(_literal(v) for v in value)
        return f"[{items}]" if isinstance(value, list) else f"({items}{',' if len(value) == 1 else ''})"
    return repr(value)


def _limits_comment(finding_measured: tuple) -> list[str]:
    lines = []
    for m in finding_measured:
        lines.append(
            f"# {m.tensor}: max-abs limit {m.max_abs_limit:.4g} (set by the {m.binding}: baseline "
            f"{m.baseline_max_abs:.3g} x 4, floor {m.floor:.3g}, cap {m.cap:.3g}); rel-RMS limit "
            f"{m.rel_rms_limit:.4g} (set by the {m.rel_rms_binding}: baseline {m.baseline_rel_rms:.3g} x 2)"
        )
    return lines


def called_measurements(finding: object, backend: Backend) -> tuple:
    """What the file holds a direct call on the finding's smallest case to: the budget check's measurements of
    its output and final states on ``backend``, else the offsets check's past 2^31 (the call behind its
    filler), else the gradients check's of its whole backward (each gradient)."""
    mine = [m for m in finding.measured if m.backend == backend.name]
    forward = tuple(m for m in mine if m.tensor in CALLED and m.check == "budget")
    behind = tuple(
        m for m in mine if m.tensor in CALLED and m.check == offsets.NAME and offsets.judged_filler(m.subject)
    )
    return forward or behind or tuple(m for m in mine if m.check == "gradients" and m.subject == WHOLE_BACKWARD)


def filler_of(finding: object, case: Case) -> int:
    """The tokens of zeros the file's call runs the case behind: the offsets check's filler (as its records say,
    else the check's own for the case: a crash records no measurement), none for any other check."""
    if finding.check != offsets.NAME:
        return 0
    said = [offsets.judged_filler(m.subject) for m in finding.measured]
    return next((n for n in said if n), None) or offsets.filler_tokens(case)


def takes_gradients(measured: tuple) -> bool:
    """Whether ``measured`` (:func:`called_measurements`) are a backward's: the file takes gradients."""
    return any(m.check == "gradients" for m in measured)


def _term_rms(case: Case) -> dict[str, float]:
    """The RMS of the terms each gate gradient sums, on the case's inputs: what its rel-RMS is taken against."""
    inputs = materialize(case)
    d_o, d_final = upstream_gradients(inputs)
    args = (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, inputs.options, d_o, d_final)
    terms = gate_gradient_terms(inputs, by_tensor(kda_gradients(*args)))
    return {name: rms for name, (_, rms) in term_scales(terms).items()}


# Both tests' judging: each tensor against the float64 truth and its limits.
_JUDGING = """
# Limits: limit = min(cap, max(factor x baseline, floor)), the baseline the same case through a plain PyTorch
# chunked KDA at working precision; see kda-conformance docs/tolerance.md.
{limits_comment}
LIMITS = {limits}
LIBRARY_TOLERANCE = {library}  # rel-RMS, from the library's own tests
MEASURED = {seen}  # when written, on {where}
TINY = torch.finfo(torch.float64).tiny
TOKENS = ("q", "k", "v", "g", "beta")


def first_bad(name, bad):
    at = bad.nonzero()[0].tolist()
    if name in ("final_state", "dh0"):
        return f"(sequence, head) {{tuple(at[:2])}}"
    if name in ("dA_log", "ddt_bias"):
        return f"index {{tuple(at)}}"
    return f"(row, token, head) {{tuple(at[:3])}}"


def held(name, got, want, problems, lines, scale=0.0):
    # got against the float64 want: a line of its errors, and a problem for each limit it passes. Rel-RMS is
    # over the RMS of want, or over scale where larger.
    if got is None or tuple(got.shape) != tuple(want.shape):
        shape = None if got is None else list(got.shape)
        problems.append(f"{{name}}: shape {{shape}} != {{list(want.shape)}}")
        return
    want = want.detach()
    err = (got.detach().double().cpu() - want).abs()
    nonfinite = int((~got.isfinite()).sum())
    ref = max(float(want.pow(2).mean().sqrt()) if want.numel() else 0.0, scale, TINY)
    max_abs = math.inf if nonfinite else (float(err.max()) if err.numel() else 0.0)
    rel_rms = math.inf if nonfinite else (rms_past_one_ulp(err, want, got.dtype) / ref if err.numel() else 0.0)
    if name not in LIMITS:  # a crash's finding: the call runs, and its result is whole and finite
        problems += [f"{{name}}: {{nonfinite}} non-finite values"] if nonfinite else []
        lines.append(f"{{name}}: max-abs {{max_abs:.3e}}, rel-RMS {{rel_rms:.3e}} (no limits recorded)")
        return
    limit, then = LIMITS[name], MEASURED[name]
    line = f"{{name}}: max-abs {{max_abs:.3e}} (limit {{limit['max_abs']:.3e}}), rel-RMS {{rel_rms:.3e}}"
    line += f" (limit {{limit['rel_rms']:.3e}}); when written {{then['max_abs']:.3e}}, {{then['rel_rms']:.3e}}"
    if name in LIBRARY_TOLERANCE:
        own = LIBRARY_TOLERANCE[name]
        line += f"; the library's own tolerance {{own:g}}: {{rel_rms / own:.3g}}x"
    lines.append(line)
    if nonfinite:
        problems.append(f"{{name}}: {{nonfinite}} non-finite values")
    for metric, value in (("max_abs", max_abs), ("rel_rms", rel_rms)):
        if not value <= limit[metric]:
            problem = f"{{name}}: {{metric}} {{value:.3e}} > limit {{limit[metric]:.3e}}"
            if metric == "max_abs":
                problem += ", first at " + first_bad(name, (err > limit["max_abs"]) | ~got.detach().cpu().isfinite())
            problems.append(problem)
"""

# The kernel's forward, held to the float64 token loop.
_FORWARD_TEST = """
def test_{name}():
    device = where_it_runs()
    x = draw(CASE)  # the suite's inputs, bit for bit, on the CPU
    kwargs = {call_kwargs}
    o_true, final_true = kda_token_loop(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"],
        **kwargs,
    )
    moved = {{name: None if t is None else t.to(device) for name, t in x.items()}}
{tokens}
    kwargs.update(A_log=moved["A_log"], dt_bias=moved["dt_bias"])
    h0 = None if moved["initial_state"] is None else moved["initial_state"].float()  # a pool's state, widened
    with {memory}:
        o, final = call(q, k, v, g, beta, h0, moved["cu_seqlens"], **kwargs)
{sliced}    problems, lines = [], []
    held("o", o, o_true, problems, lines)
    held("final_state", final, final_true, problems, lines)
    print("\\n".join(lines))
    assert not problems, "\\n".join(problems + lines)
"""

# The tokens handed over: in the case's memory layout, or packed behind FILLER zero tokens (the offsets check).
_AS_LAID_OUT = "    q, k, v, g, beta = laid_out(CASE.input_layout, *(moved[n] for n in TOKENS))"
_BEHIND_FILLER = """\
    # The case's sequences packed behind FILLER tokens of zeros, so that they start past 2^31 elements of the
    # token tensors (or of the per-chunk states a chunk kernel keeps); the case's rows are judged where they land.
    tokens = {n: moved[n] for n in TOKENS}
    tokens, moved["initial_state"], moved["cu_seqlens"] = behind_filler(
        tokens, moved["initial_state"], moved["cu_seqlens"], FILLER
    )
    q, k, v, g, beta = (tokens[n] for n in TOKENS)"""
_FILLER_SLICED = """\
    o, final = o[:, FILLER:], None if final is None else final[1:]  # the case's rows, its sequences' states
"""


# The kernel's backward, held to float64 gradients: autograd through the token loop.
_BACKWARD_TEST = """
# The gradient of each input, by the name reports give it.
GRADIENT_OF = {gradient_of!r}
# The gate's gradients sum terms that cancel: their rel-RMS is taken against the RMS of those terms (|q dq| and
# |k dk| times the gate's derivative, token by token) where larger than their own, computed by kda-conformance on
# these very inputs (its docs/tolerance.md, "Gradients").
TERM_RMS = {term_rms}


def leaf(x):
    # A copy with x's strides that requires a gradient.
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x).requires_grad_()


def test_{name}():
    device = where_it_runs()
    x = draw(CASE)  # the suite's inputs, bit for bit, on the CPU
    up = upstream(CASE)  # the gradients of the loss sum(o * d_o) + sum(final_state * d_final)
    kwargs = {call_kwargs}
    wrt = [n for n in GRADIENT_OF if x.get(n) is not None and (CASE.gate_in_kernel or n not in ("A_log", "dt_bias"))]
    # The float64 truth: autograd through the plain token loop.
    exact = {{n: x[n].double().requires_grad_() for n in wrt}}
    o64, final64 = kda_token_loop(
        *(exact[n] for n in TOKENS), initial_state=exact.get("initial_state"), cu_seqlens=x["cu_seqlens"],
        **dict(kwargs, A_log=exact.get("A_log", x["A_log"]), dt_bias=exact.get("dt_bias", x["dt_bias"])),
    )
    loss = (o64 * up["d_o"].double()).sum() + (final64 * up["d_final"].double()).sum()
    want = dict(zip(wrt, torch.autograd.grad(loss, [exact[n] for n in wrt])))
    # The kernel's own backward, on its inputs as the suite hands them (laid out; the state widened to fp32).
    moved = {{name: None if t is None else t.to(device) for name, t in x.items()}}
    given = dict(zip(TOKENS, laid_out(CASE.input_layout, *(moved[n] for n in TOKENS))))
    given.update(initial_state=None if moved["initial_state"] is None else moved["initial_state"].float())
    given.update(A_log=moved["A_log"], dt_bias=moved["dt_bias"])
    given.update({{n: leaf(given[n]) for n in wrt}})
    kwargs.update(A_log=given["A_log"], dt_bias=given["dt_bias"])
    with {memory}:
        o, final = call(*(given[n] for n in TOKENS), given["initial_state"], moved["cu_seqlens"], **kwargs)
    pairs = [(t, d.to(device=device, dtype=t.dtype)) for t, d in ((o, up["d_o"]), (final, up["d_final"]))]
    pairs = [(t, d) for t, d in pairs if t.requires_grad]
    assert pairs, "the kernel's outputs carry no autograd graph"
    got = torch.autograd.grad(
        [t for t, _ in pairs], [given[n] for n in wrt], [d for _, d in pairs], materialize_grads=True
    )
    problems, lines = [], []
    for n, grad in zip(wrt, got):
        if n == "initial_state":  # in the state's own dtype, as its pool holds it
            grad = grad.to(x["initial_state"].dtype)
        held(GRADIENT_OF[n], grad, want[n], problems, lines, TERM_RMS.get(GRADIENT_OF[n], 0.0))
    print("\\n".join(lines))
    assert not problems, "\\n".join(problems + lines)
"""


def measured_device_type(finding: object) -> str:
    """Where the finding's smallest case was measured: ``cpu``, or ``cuda`` for a GPU (the device a standalone
    file runs its kernel on, and skips without)."""
    return "cpu" if finding.environment.startswith("cpu") else "cuda"


def standalone_file_text(finding: object, case: Case, backend: Backend, file_name: str) -> str:
    """The whole file for ``finding`` (a kda_conformance.repro.upstream UpstreamFinding) on ``case`` and
    ``backend`` (its ``standalone_source`` gives the call), to be saved as ``file_name``: the kernel's forward
    held to the truth, or its backward where the finding's measurements are gradients."""
    assert backend.standalone_source is not None
    measured = called_measurements(finding, backend)
    backward = takes_gradients(measured)
    device_type = measured_device_type(finding)
    where = finding.environment or "the device it was written on"
    limits = {m.tensor: {"max_abs": m.max_abs_limit, "rel_rms": m.rel_rms_limit} for m in measured}
    library = {m.tensor: m.library_tolerance for m in measured if not math.isnan(m.library_tolerance)}
    tolerance = backend.library_tolerance
    seen = {m.tensor: {"max_abs": m.max_abs, "rel_rms": m.rel_rms, "nonfinite": m.nonfinite} for m in measured}
    precision = next((m.precision for m in measured if m.precision), "")
    trees = [lib for lib in backend.libraries if lib.source_variable]
    filler = filler_of(finding, case)
    doc = [
        f"{finding.id}: {finding.kernel or backend.name}, {case.label}.",
        "",
        textwrap.fill(f"What goes wrong: {finding.description}", 110),
        "",
        f"Measured with kda-conformance (backend {backend.name}, check {finding.check}) on {where}: "
        + "; ".join(f"{t} max-abs {v['max_abs']:.3g}, rel-RMS {v['rel_rms']:.3g}" for t, v in seen.items())
        + ". The limits below are the suite's (docs/tolerance.md in kda-conformance)"
        + (f", at the kernel's declared working precision ({precision})" if precision else "")
        + (
            f"; the library's own tests allow rel-RMS {tolerance.rel_rms:g} ({tolerance.source})." if tolerance else "."
        ),
    ]
    if filler:
        said = (
            f"The case runs packed behind {filler} tokens of zeros (FILLER), so that its first token lies past 2^31 "
            "elements of the token tensors (and of the per-chunk states a chunk kernel keeps); the truth is the case's "
            "own, and its rows are judged where they land. A 32-bit offset wraps there."
        )
        doc += ["", textwrap.fill(said, 110)]
    if backward:
        said = (
            "The gradients are those of sum(o * d_o) + sum(final_state * d_final) with respect to each input, d_o "
            "and d_final drawn from the case's seed, through the kernel's own autograd; the float64 truth is "
            "autograd through the token loop below."
        )
        doc += ["", textwrap.fill(said, 110)]
    if finding.links:
        doc += ["", "Upstream:", *(f"- {link}" for link in finding.links)]
    doc += [
        "",
        f"Run: pytest {file_name} (needs torch, pytest and {', '.join(lib.name for lib in backend.libraries)}"
        + "".join(f"; {lib.source_variable}=DIR loads it from a source tree" for lib in trees)
        + "). It fails while the kernel is wrong, passes once it is right, and skips naming what is missing.",
        f"Case (kda-conformance --case): {case.to_json()}",
    ]
    header = '"""' + "\n".join(doc).replace('"""', "'''").replace("\\", "\\\\") + '\n"""\n'
    judging = _JUDGING.format(
        limits_comment="\n".join(_limits_comment(measured)),
        limits=_literal(limits),
        library=_literal(library),
        seen=_literal(seen),
        where=where,
    )
    # Non-finite values when measured: the call runs with the memory it does not write poisoned (NaN).
    poisoned = any(m.nonfinite for m in measured)
    test = (_BACKWARD_TEST if backward else _FORWARD_TEST).format(
        name=finding.id.replace("-", "_"),
        memory='poisoned_scratch(torch.device(device), "nan")' if poisoned else "contextlib.nullcontext()",
        call_kwargs=textwrap.indent(_call_kwargs(case), "    ").lstrip(),
        term_rms=_literal(_term_rms(case) if backward else {}),
        gradient_of=GRADIENT_TENSORS,
        tokens=_BEHIND_FILLER if filler else _AS_LAID_OUT,
        sliced=_FILLER_SLICED if filler else "",
    )
    if filler:
        judging += f"FILLER = {filler}  # tokens of zeros the case's sequences are packed behind\n"
    imports = "\n".join(f"import {name}" for name in ("contextlib", "importlib", "itertools", "math", "os", "sys"))
    imports += "\nfrom collections.abc import Iterator\nfrom contextlib import contextmanager\nfrom pathlib import Path"
    imports += "\nfrom types import SimpleNamespace\nfrom typing import Any\n\nimport pytest\nimport torch\n"
    imports += "import torch.nn.functional as F\n"
    return "\n".join(
        [
            header,
            imports,
            case_spec_source(case),
            embedded_source(),
            "# ---- the kernel, called as its server calls it " + "-" * 40,
            _needs_source(backend),
            *([embedded_source(backend.standalone_modules)] if backend.standalone_modules else []),
            backend.standalone_source(case),
            _where_it_runs_source(device_type, where),
            *([poisoned_memory_source()] if poisoned else []),
            rel_rms_source(),
            judging,
            test,
        ]
    )


def write_standalone_finding(finding: object, case: Case, backend: Backend, folder: Path, name: str) -> Path:
    """Write ``folder/name`` (a ``test_*.py``) for the finding; returns its path."""
    path = Path(folder) / name
    atomic_write_text(path, standalone_file_text(finding, case, backend, path.name))
    return path


def imports_of_the_suite(source: str) -> list[str]:
    """The imports of this suite's packages in a file's source (a standalone file has none)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            if getattr(node.func, "id", getattr(node.func, "attr", "")) in ("needs", "import_module", "__import__"):
                names = [str(node.args[0].value)]
        found += [name for name in names if name.split(".")[0] in SUITE_PACKAGES]
    return found


def issue_text(finding: object) -> str:
    """The finding as an upstream issue: title, what goes wrong, environment, repro, expected against actual,
    suspected cause, related upstream issues and fixes (``kda-conformance findings --report ID``)."""
    title = finding.title or finding.description.split(". ")[0]
    lines = [f"# {title.rstrip('.')}", "", "## What goes wrong", "", finding.description]
    if finding.tier:
        lines += ["", f"How bad (kda-conformance's tier): {finding.tier}."]
    lines += ["", "## Environment", "", f"Measured on {finding.environment or 'an unrecorded machine'}, run "
              f"{finding.run or '-'}; backends {finding.backends}; checks {finding.check}."]  # fmt: skip
    if finding.copies:
        lines += ["", "The same code path lives in:", "", *(f"- {copy}" for copy in finding.copies)]
    lines += ["", "## Repro", ""]
    if finding.test and finding.test.startswith("test_"):
        lines += [f"`pytest {finding.test.split(' ')[0]}` (torch, the kernel's package and pytest; attached)."]
    if finding.repro:
        lines += ["", "With kda-conformance:", "", f"    {finding.repro}"]
    lines += ["", f"Smallest failing case: {finding.case_id}", "", "## Expected and actual", ""]
    if finding.measured:
        lines += [
            "| backend | check | tensor | max-abs | its limit | rel-RMS | its limit | times the limits "
            "| the library's own tolerance |"
        ]
        lines += ["|---|---|---|---|---|---|---|---|---|"]
        for m in finding.measured:
            own = "-" if math.isnan(m.library_tolerance) else f"{m.library_tolerance:g}"
            part = f" ({m.subject})" if m.subject and m.subject != WHOLE_BACKWARD else ""  # a sequence alone...
            # The record's worst ratio: a reader sees at once which rows failed (past 1) and by how much.
            lines.append(
                f"| {m.backend} | {m.check}{part} | {m.tensor} | {m.max_abs:.3e} | {m.max_abs_limit:.3e} "
                f"| {m.rel_rms:.3e} | {m.rel_rms_limit:.3e} | {m.worst:.3g} | {own} |"
            )
        lines += ["", "Expected: within the limits, which kda-conformance derives from a plain PyTorch port of the "
                  "same chunked algebra at the same precision (docs/tolerance.md); actual: the measured errors "
                  "against a float64 token-by-token recurrence."]  # fmt: skip
    else:
        lines.append(f"Worst: {finding.worst}.")
    lines += ["", "## Suspected cause", "", finding.upstream or "not established"]
    if finding.confirmed:
        lines += ["", f"How it was confirmed: {finding.confirmed}"]
    lines += ["", "## Related upstream issues and fixes", ""]
    lines += [f"- {link}" for link in finding.links] or ["- none known"]
    return "\n".join(lines) + "\n"
