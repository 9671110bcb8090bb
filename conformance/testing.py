"""The suite from a kernel engineer's own test file, in the spirit of ``torch.testing.assert_close``.

    from kda_conformance.testing import Case, assert_conforms, kda_cases

    def test_my_kernel_on_a_long_packed_batch():
        assert_conforms(my_chunk_kda, Case(seq_lens=(2047, 0, 2049), packed=True, initial_state="random"))

    @given(kda_cases("ci", dtype="bf16"))
    def test_my_kernel_on_drawn_cases(case):
        assert_conforms(my_chunk_kda, case)

``assert_conforms`` takes any callable with FLA's ``chunk_kda`` signature (``q, k, v, g, beta`` and its
keywords; FLA's ``fused_recurrent_kda`` too), a registered backend's name or a :class:`Backend`, and a case
or a list of cases; it runs the suite's checks through the suite's executor (the float64 truth, the
same-precision baseline and its limits, the call contract, the ledger of known issues) and raises an
``AssertionError`` whose message is the suite's report: every limit and ratio, the first bad point and a line
that reruns it. ``kda_cases`` is the suite's Hypothesis strategy of cases, a profile's, with fields fixed.

With ``pytest_plugins = ["kda_conformance.testing"]`` in a conftest, the fixture ``kda_checker`` does the
same and keeps the records of the session in a run store (``KDA_OUT``, default ``out``), which the suite's
dashboard reads. The names a backend plugin needs (``Backend``, ``Envelope``, ``register``, ...) are here
too, from ``kda_kernels.api``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import reject
from hypothesis import strategies as st

from kda_cases.case import Case, did_you_mean
from kda_cases.envelope import ANY
from kda_cases.materialize import KDAOptions
from kda_cases.presets import PRESETS as PRESETS
from kda_cases.presets import preset as library_preset
from kda_cases.profiles import get_profile
from kda_cases.strategies import cases as profile_cases
from kda_conformance.checks import get_check, run_check
from kda_conformance.checks._tests import check_report
from kda_conformance.running.config import RunConfig
from kda_conformance.running.run import Run
from kda_kernels import api, guard, registry, triton_interpret
from kda_kernels.api import *  # noqa: F403  (the plugin face's names, re-exported: see __all__)
from kda_kernels.api import Backend, BackendOutput, Envelope, KDAInputs, Support, stored
from kda_kernels.backward import autograd_backward
from kda_kernels.envelope import CHUNK_KDA
from kda_reference.gradients import Gradients
from kda_reports.findings import Finding

# The plugin face's names (kda_kernels.api) and this module's own.
__all__ = [
    *api.__all__,
    *("CallableBackend", "Checker", "as_backend", "assert_conforms", "conforms", "kda_cases", "kda_checker"),
    *("PRESETS", "preset", "use_triton_interpreter_on_cpu"),
]

Kernel = Callable[..., Any] | Backend | str


def preset(name: str, **fields: object) -> Case:
    """A Case in the conventions of ``name``, ``fields`` over them: a library's tests (:data:`PRESETS`:
    ``"fla"``, chunk_kda's own defaults), or a server's layer, named by the registered backend that calls its
    kernel as the layer does (``"vllm_glm5_chunk"``, ``"vllm_chunk"``, ``"sglang_chunk"``, ...): the case moved
    into that backend's envelope, so the fields its layer fixes (the gate form and safe gate, the in-kernel
    normalisation, equal head sizes, no GVA, the dtypes it takes) are the layer's and every other is as given."""
    if name in PRESETS:
        return library_preset(name, **fields)
    if name in registry.names():
        return guard.fit(registry.get(name), Case(**fields))
    choices = [*PRESETS, *registry.names()]
    raise ValueError(
        f"preset {name!r} is unknown{did_you_mean(name, choices)}; choose a library's ({', '.join(PRESETS)}) or "
        f"a backend's layer ({', '.join(registry.names())})"
    )


# What a case computes in the kernel that FLA's own tests compute before the call (preset "fla" drops them).
IN_KERNEL_FLAGS = {"use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "use_gate_in_kernel"}


def needed_keywords(case: Case) -> dict[str, str]:
    """chunk_kda's keywords that ``case`` passes a value that matters to (not None or False), each with why; which
    keywords a case sets is KDAOptions.of's word (cases/materialize.py), the one place that says it."""
    present = object()  # a tensor the case has (its value does not matter here)
    tensors = dict(
        initial_state=present if case.has_initial_state else None,
        cu_seqlens=present if case.packed else None,
        A_log=present if case.gate_in_kernel else None,
        dt_bias=present if case.gate_in_kernel else None,
    )
    keywords = KDAOptions.of(case, **tensors).kernel_kwargs()
    gate = f"the {case.gate} gate computed in the kernel"
    why = {
        "scale": f"scale {case.scale:g}" if case.scale is not None else "",
        "initial_state": "an initial state",
        "cu_seqlens": "packed sequences",
        "use_qk_l2norm_in_kernel": "q and k normalised in the kernel",
        "use_beta_sigmoid_in_kernel": "beta's sigmoid in the kernel",
        "use_gate_in_kernel": gate,
        "A_log": gate,
        "dt_bias": gate,
        "lower_bound": f"the gate's lower bound {case.lower_bound:g}" if case.lower_bound is not None else "",
        "state_v_first": "a [V, K] state",
    }
    if not case.gate_in_kernel:  # a precomputed gate holds its bound already (cases/seeded.py clamps it)
        keywords.pop("lower_bound")
    return {name: why[name] for name, value in keywords.items() if value is not None and value is not False}


class CallableBackend(Backend):
    """A function with ``chunk_kda``'s signature as a backend: called the way FLA's adapter calls
    ``chunk_kda`` (the case's inputs and keywords, an fp32 initial state, ``output_final_state=True``), with
    ``safe_gate`` where its signature names it. Its envelope is ``chunk_kda``'s unless given.

    A function that names its keywords (no ``**kwargs``) is passed only those; a case that needs one it
    lacks (``cu_seqlens`` for packed sequences, ``use_gate_in_kernel`` for a gate computed in the kernel,
    ...) is outside it, said before any call (:meth:`supports`), never a TypeError from the call."""

    def __init__(self, function: Callable[..., Any], name: str | None = None, envelope: Envelope | None = None):
        self.function = function
        self.name = name or getattr(function, "__qualname__", None) or type(function).__name__
        self.description = f"{self.name}, a chunk_kda-style callable checked from a test file"
        self.envelope = envelope or CHUNK_KDA
        self.signature = ""  # "" where it has none to read (a builtin, a C++ op): it is passed every keyword
        self.named: set[str] = set()  # the parameters it names
        self.takes_any = True  # it takes keywords it does not name (**kwargs, or no signature to read)
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):
            return
        self.signature, self.named = str(signature), set(signature.parameters)
        self.takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())

    def availability(self, device: torch.device) -> Support:
        return Support.yes()

    def supports(self, case: Case) -> Support:
        within = super().supports(case)
        lacking = {} if self.takes_any else {k: why for k, why in needed_keywords(case).items() if k not in self.named}
        if not within or not lacking:
            return within
        said = ", ".join(f"{k} ({why})" for k, why in lacking.items())
        reason = f"{self.name} takes no keyword {said}, which this case needs; its signature: {self.signature}"
        if lacking.keys() & IN_KERNEL_FLAGS:
            reason += "; chunk_kda's own defaults (a precomputed gate and beta, l2norm outside) are preset('fla', ...)"
        return Support.no(reason)

    def dropped_hint(self, case: Case) -> str:
        """Where the function takes ``**kwargs``: the keywords this case needs that reach it only that way (a
        wrapper that swallows them computes another function than the case's)."""
        through = [k for k in needed_keywords(case) if k not in self.named] if self.signature and self.takes_any else []
        if not through:
            return ""
        return (
            f"note: {self.name} takes {', '.join(through)} only through **kwargs ({self.signature}); a wrapper "
            "that drops them computes another function than this case's"
        )

    def _keywords(self, inputs: KDAInputs) -> dict[str, Any]:
        kwargs = {**inputs.kernel_kwargs(), **(inputs.host_metadata or {})}
        state = inputs.initial_state
        kwargs["initial_state"] = None if state is None else state.float()
        if not self.takes_any:  # the keywords it names; the rest hold None or False here (supports)
            kwargs = {key: value for key, value in kwargs.items() if key in self.named}
        if "safe_gate" in self.named or not self.signature:  # where it names it: older kernels have none
            kwargs["safe_gate"] = inputs.case.safe_gate
        return kwargs

    def run(self, inputs: KDAInputs) -> BackendOutput:
        kwargs = self._keywords(inputs)
        with torch.inference_mode():
            o, final = self.function(
                inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, output_final_state=True, **kwargs
            )
        return BackendOutput(o=o, final_state=stored(inputs.case, "final_state", final))

    def run_backward(self, inputs: KDAInputs, d_o: torch.Tensor, d_final: torch.Tensor | None) -> Gradients:
        """The function's own backward, through autograd: called as :meth:`run` calls it, outside inference
        mode, on inputs that require gradients (with ``grad=True``, its envelope declares a backward pass)."""

        call = functools.partial(self.function, output_final_state=True)
        return autograd_backward(inputs, d_o, d_final, call, self._keywords(inputs))


def as_backend(kernel: Kernel, name: str | None = None, envelope: Envelope | None = None) -> Backend:
    """``kernel`` as a backend: a :class:`Backend` as it is, a registered backend by its name, a callable with
    ``chunk_kda``'s signature wrapped (:class:`CallableBackend`)."""
    if isinstance(kernel, Backend):
        return kernel
    if isinstance(kernel, str):
        try:
            return registry.get(kernel)
        except KeyError:
            known = ", ".join(registry.names())
            raise ValueError(f"kernel {kernel!r} is no registered backend; choose from {known}") from None
    if not callable(kernel):
        raise TypeError(f"kernel must be a callable with chunk_kda's signature, a Backend or a backend's name, "
                        f"got {type(kernel).__name__}")  # fmt: skip
    return CallableBackend(kernel, name, envelope)


def with_backward(backend: Backend) -> Backend:
    """A callable's backend declared to have a backward pass (its own autograd); any other backend as it is,
    which declares its own (a registered one without a backward is then said to have none)."""
    if isinstance(backend, CallableBackend) and not backend.envelope.backward:
        return CallableBackend(backend.function, backend.name, dataclasses.replace(backend.envelope, backward=True))
    return backend


def _cases(cases: Case | Mapping | str | Iterable[Case | Mapping | str]) -> list[Case]:
    if isinstance(cases, Case | Mapping | str):
        cases = [cases]
    found = []
    for case in cases:
        if isinstance(case, Mapping):
            case = Case.from_json(json.dumps(dict(case)))
        elif isinstance(case, str):
            case = Case.from_json(case)
        if not isinstance(case, Case):
            raise TypeError(f"cases must be Case objects, their JSON or dicts, got {type(case).__name__}")
        found.append(case)
    return found


@functools.cache
def _run(device: str) -> Run:
    """One run per device for the process, so that every call shares its truth cache; it writes nothing."""
    return Run(RunConfig(device=torch.device(device), backends=()), journal=False)


def _device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def assert_conforms(
    kernel: Kernel,
    cases: Case | Mapping | str | Iterable[Case | Mapping | str],
    *,
    checks: Sequence[str] = ("budget",),
    params: Mapping[str, object] | None = None,
    device: str | torch.device | None = None,
    strict: bool = False,
    grad: bool = False,
) -> list[Finding]:
    """Check ``kernel`` on ``cases`` with the suite's ``checks`` (``budget``: within the limits of the float64
    truth; any registered check, with its parameters in ``params``, e.g. ``checks=["split_resume"],
    params={"at": 17}``) on ``device`` (default: a GPU if torch sees one). ``grad=True`` adds the ``gradients``
    check: the kernel's backward through autograd, each gradient within its budget against the float64
    gradients (a callable is declared to have one). Returns every finding; raises ``AssertionError`` with the
    suite's report when a check fails or errs (a warning too when ``strict``), and ``ValueError`` for a case
    outside the kernel's envelope or a check's missing parameter."""
    device = _device(device)
    if grad:
        kernel = with_backward(as_backend(kernel))
        checks = (*checks, *(() if "gradients" in checks else ("gradients",)))
    findings, reports = conforms(kernel, cases, _run(str(device)), checks=checks, params=params, strict=strict)
    if reports:
        raise AssertionError("\n\n".join(reports))
    return findings


def conforms(
    kernel: Kernel,
    cases: Case | Mapping | str | Iterable[Case | Mapping | str],
    run: Run,
    *,
    checks: Sequence[str] = ("budget",),
    params: Mapping[str, object] | None = None,
    strict: bool = False,
) -> tuple[list[Finding], list[str]]:
    """:func:`assert_conforms` through ``run``: every finding, and the report of each failing check."""
    backend = as_backend(kernel)
    chosen = [get_check(name) for name in checks]
    params = dict(params or {})
    for check in chosen:
        missing = [p for p in check.params if p.name not in params]
        if missing:
            said = "; ".join(f"{p.name}: {p.help}" for p in missing)
            raise ValueError(f"params: check {check.name} takes {', '.join(p.name for p in missing)} ({said})")
    fails = (lambda f: f.failed or f.verdict == "warn") if strict else (lambda f: f.failed)
    findings, reports = [], []
    for case in _cases(cases):
        support = guard.supports(backend, case)  # the case as given: never moved into the envelope unasked
        if not support:
            raise ValueError(f"cases: {case.id} ({case.label}) is outside {backend.name}'s envelope: {support.reason}")
        for check in chosen:
            mine = {p.name: params[p.name] for p in check.params}
            found = run_check(check, case, backend, run.config.device, mine, run)
            if isinstance(backend, CallableBackend):  # no command line can load it: the repro is Python's
                short = backend.name.rsplit(".", 1)[-1]  # scaled.<locals>.k: no file can import that name
                again = f"assert_conforms({short}, Case.from_json({case.to_json()!r}), checks=[{check.name!r}]"
                again += f", params={mine!r})" if mine else ")"
                if "<" in backend.name:
                    again += f"  # {backend.name} is defined inside a function: not importable, pass that callable"
                found = [dataclasses.replace(f, repro=again) for f in found]
            findings += found
            report = check_report(check, found, mine, fails)
            hint = backend.dropped_hint(case) if isinstance(backend, CallableBackend) else ""
            if report:
                reports.append(f"{report}\n{hint}" if hint else report)
    return findings, reports


def kda_cases(profile: str = "ci", envelope: Envelope | None = None, **fixed: object) -> st.SearchStrategy[Case]:
    """The suite's strategy of cases for ``profile`` (``smoke``, ``ci``, ``nightly``, ``long``), drawn inside
    ``envelope`` (a backend's, say ``as_backend(k).envelope``) with the :class:`Case` fields in ``fixed``
    set (``kda_cases("ci", dtype="bf16", head_k_dim=128, head_v_dim=128)``); a drawn case that cannot take
    them is rejected, not failed."""
    fields = set(Case.__dataclass_fields__)
    unknown = sorted(set(fixed) - fields)
    if unknown:
        hints = "".join(did_you_mean(name, fields) for name in unknown)
        said = f"kda_cases: {', '.join(unknown)} are no Case fields{hints}"
        raise ValueError(f"{said}; choose from {', '.join(sorted(fields))}")
    drawn = profile_cases(get_profile(profile), envelope or ANY)
    return drawn.map(functools.partial(_with_fields, fixed)) if fixed else drawn


def _with_fields(fixed: Mapping[str, object], case: Case) -> Case:
    try:
        return case.replace(**fixed)
    except ValueError:  # a drawn case the fixed fields do not fit (a bound past the gate's range, say)
        reject()


def use_triton_interpreter_on_cpu() -> None:
    """Run Triton kernels (FLA's) in Triton's CPU interpreter, with the suite's workarounds
    (``kda_kernels.triton_interpret``): call before anything imports triton or fla. Raises where the
    interpreter cannot run here, saying why."""
    problem = triton_interpret.problem()
    if problem:
        raise RuntimeError(f"Triton's interpreter cannot run here: {problem}")
    triton_interpret.enable()


class Checker:
    """:func:`assert_conforms` on one run for a whole pytest session, whose records go to a run store."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def __call__(self, kernel: Kernel, cases: Any, **options: Any) -> list[Finding]:
        findings, reports = conforms(kernel, cases, self.run, **options)
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0] or None
        self.run.record(findings, test)
        if reports:
            raise AssertionError("\n\n".join(reports))
        return findings


@pytest.fixture(scope="session")
def kda_checker() -> Iterator[Checker]:
    """A session's :func:`assert_conforms` (``kda_checker(kernel, cases, checks=..., params=...)``), its
    records written to the run store ``KDA_OUT`` (default ``out``) when the session ends: with
    ``pytest_plugins = ["kda_conformance.testing"]`` in a conftest. ``KDA_DEVICE`` picks the device."""
    out = Path(os.environ.get("KDA_OUT", "out"))
    run = Run(RunConfig(device=_device(os.environ.get("KDA_DEVICE")), backends=(), out=out, command="pytest"))
    yield Checker(run)
    run.finish()
