"""Adapters for AITER's KDA prefill, ``aiter.ops.triton.kimi_delta_attn.chunk_kimi_delta_attn``.

Four backends, each detected from the function's signature and the modules' attributes, never from a
version string:

- ``aiter_flashkda``: FlashKDA (chunk 32, two kernels and a segment scan), with its segment length left
  to AITER's default, which depends on the GPU's CU count; ``aiter_flashkda_seg16`` pins segments of 16
  chunks (512 tokens) and ``aiter_flashkda_unsegmented`` switches segmentation off, through
  ``CHUNK_DELTA_ATTN_FLASH_KDA_SEG``, so their numerics do not depend on the machine;
- ``aiter_default``: the FLA-derived default pipeline (chunk 64), FlashKDA switched off;
- ``aiter_native``: ``backend="native"``, the HIP port on gfx942/gfx950, where the signature has ``backend``;
- ``aiter_paged``: the in-place paged API (``out``, ``state_cache``, ``state_indices``,
  ``has_initial_state``), where the signature has it; the serving checks call it directly.

FlashKDA's on/off switch is a module constant AITER reads from the environment when it is imported
(``CHUNK_DELTA_ATTN_USE_FLASH_KDA``, later ``AITER_FDA_ENABLE``); the adapter sets that constant around each
call instead, so which path runs is decided per backend, not by the environment at import time. Cases that
AITER's own ``flash_kda_supported`` would send to the default pipeline are outside the FlashKDA backends'
envelope (said in ``supports``), so a FlashKDA result is always FlashKDA's.

Importing must not start AITER's HIP build: ``AITER_TRITON_ONLY=1`` is set, and with ``KDA_AITER_SRC``
naming a source checkout (the folder holding ``aiter/``), ``aiter`` and ``aiter.ops`` are registered as
bare packages whose ``__init__`` never runs (docs/amd-ci.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar

import torch

from kda_cases.case import GATE_DTYPES, Case
from kda_cases.devices import gpu_arch
from kda_cases.dtypes import stored
from kda_cases.materialize import KDAInputs
from kda_kernels import triton_interpret
from kda_kernels.backends.fla import FLA_CHUNK_FAMILY, fla_chunk_scratch_bytes_per_token
from kda_kernels.envelope import CHUNK_KDA, FLASH_KDA, SAFE_LOWER_BOUND_RANGE
from kda_kernels.libraries import AITER
from kda_kernels.protocol import Backend, BackendOutput, Support, Unsupported, WorkingPrecision

ENTRY = "aiter.ops.triton.kimi_delta_attn"
FLASH_KDA_SWITCHES = ("AITER_FDA_ENABLE", "CHUNK_DELTA_ATTN_USE_FLASH_KDA")
SEGMENT_VARIABLE = "CHUNK_DELTA_ATTN_FLASH_KDA_SEG"
# The call's arguments AITER's flash_kda_supported judges (besides q, v, chunk_size and safe_gate).
FLASH_KDA_CHECKED = (
    "use_gate_in_kernel",
    "use_qk_l2norm_in_kernel",
    "use_beta_sigmoid_in_kernel",
    "lower_bound",
    "A_log",
)
NATIVE_ARCHS = ("gfx942", "gfx950")


class AiterMissing(RuntimeError):
    """AITER's KDA prefill cannot be imported here; the message says why."""


def _import_entry() -> Callable:
    """``chunk_kimi_delta_attn``, imported without AITER's HIP build."""
    os.environ.setdefault("AITER_TRITON_ONLY", "1")
    source = os.environ.get("KDA_AITER_SRC")
    if source and "aiter" not in sys.modules:
        root = Path(source) / "aiter"
        if not (root / "ops" / "triton").is_dir():
            raise AiterMissing(f"KDA_AITER_SRC={source} holds no aiter/ops/triton source folder")
        for name, folder in (("aiter", root), ("aiter.ops", root / "ops")):
            package = types.ModuleType(name)
            package.__path__ = [str(folder)]  # a bare package: its __init__ (the HIP JIT) never runs
            sys.modules[name] = package
    elif not source and importlib.util.find_spec("aiter") is None:
        raise AiterMissing("aiter is not installed and KDA_AITER_SRC names no source checkout (docs/amd-ci.md)")
    try:
        module = importlib.import_module(ENTRY)
    except Exception as exc:  # a broken or partial checkout: say so, do not crash the sweep
        raise AiterMissing(f"importing {ENTRY} failed: {type(exc).__name__}: {exc}") from exc
    entry = getattr(module, "chunk_kimi_delta_attn", None)
    if entry is None:
        raise AiterMissing(f"{ENTRY} has no chunk_kimi_delta_attn")
    return entry


def _aiter_modules() -> list[types.ModuleType]:
    return [m for name, m in list(sys.modules.items()) if name.startswith("aiter.") and m is not None]


@contextlib.contextmanager
def _flash_kda(enabled: bool, segment: int | None) -> Iterator[None]:
    """FlashKDA on or off (the module constants AITER read at import), the segment length pinned or not."""
    patched = [(m, name, getattr(m, name)) for m in _aiter_modules() for name in FLASH_KDA_SWITCHES if hasattr(m, name)]
    if not patched:
        raise Unsupported(f"none of AITER's modules has a FlashKDA switch ({', '.join(FLASH_KDA_SWITCHES)})")
    before = os.environ.get(SEGMENT_VARIABLE)
    try:
        for module, name, _ in patched:
            setattr(module, name, enabled)
        _set_env(SEGMENT_VARIABLE, None if segment is None else str(segment))
        yield
    finally:
        for module, name, value in patched:
            setattr(module, name, value)
        _set_env(SEGMENT_VARIABLE, before)


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _flash_kda_predicate() -> Callable | None:
    """AITER's own admission check for FlashKDA, where its modules have one."""
    for module in _aiter_modules():
        check = getattr(module, "flash_kda_supported", None)
        if callable(check):
            return check
    return None


# The ``call`` of a standalone repro file (``kda-conformance findings --write-tests``): AITER's entry point with
# only torch, AITER (or its source checkout, named by KDA_AITER_SRC) and pytest, on the path the backend runs.
_STANDALONE = """

def call(q, k, v, g, beta, initial_state, cu_seqlens, **kwargs):
    import types

    os.environ.setdefault("AITER_TRITON_ONLY", "1")
    tree = os.environ.get("KDA_AITER_SRC")
    if tree and "aiter" not in sys.modules:
        # AITER's Triton source without its HIP build: aiter and aiter.ops as bare packages, their __init__
        # (a JIT build of the HIP kernels) never run.
        for name, folder in (("aiter", ("aiter",)), ("aiter.ops", ("aiter", "ops"))):
            package = types.ModuleType(name)
            package.__path__ = [os.path.join(tree, *folder)]
            sys.modules[name] = package
    entry = needs("aiter.ops.triton.kimi_delta_attn").chunk_kimi_delta_attn
    # The path: FlashKDA {path}, through the module constants AITER reads from the environment at import.
    for module in [m for n, m in list(sys.modules.items()) if n.startswith("aiter.") and m is not None]:
        for switch in {switches!r}:
            if hasattr(module, switch):
                setattr(module, switch, {flash_kda!r})
    {segment}{before_call}{admission}
    h0 = None if initial_state is None else initial_state.float()
    return entry(
        q, k, v, g, beta, initial_state=h0, cu_seqlens=cu_seqlens, output_final_state=True,
        safe_gate={safe_gate!r}, chunk_size=None, {extra}**kwargs
    )
"""
# The FlashKDA path's lines of that ``call``: AITER's own admission check first, as ``_check_path`` asks it (where
# it refuses, AITER runs its default pipeline instead and the file would test another path).
_STANDALONE_ADMISSION = """
    for module in [m for n, m in list(sys.modules.items()) if n.startswith("aiter.") and m is not None]:
        if callable(getattr(module, "flash_kda_supported", None)):
            checked = {{name: kwargs.get(name) for name in {checked!r}}}
            admitted = module.flash_kda_supported(q=q, v=v, chunk_size=32, safe_gate={safe_gate!r}, **checked)
            print(f"AITER's flash_kda_supported says {{admitted}}: the FlashKDA path", "runs" if admitted else
                  "is refused, and AITER would run its default pipeline")
            assert admitted, "AITER refuses the FlashKDA path on this call: the file would test another one"
            break"""


class AiterBackend(Backend):
    """Common ground: availability, the envelope, the call with the case's arguments."""

    flash_kda = False
    segment: int | None = None
    # Both pipelines load g and beta as they come and widen them in the kernel (flash_kda.py: g_raw and beta
    # loaded .to(tl.float32)); its docstring's example hands float32 beta.
    envelope = CHUNK_KDA
    libraries = (AITER,)
    # Its import without the HIP build, the interpreter on a CPU, and the fp32 dot precision AITER's
    # gated_delta_rule_utils sets at import on NVIDIA cards without TF32 (as FLA's copy does).
    sets_environment = ("AITER_TRITON_ONLY", triton_interpret.VARIABLE, "TRITON_F32_DEFAULT")
    needs: tuple[str, ...] = ()  # parameters the signature must have
    extra: ClassVar[dict[str, object]] = {}  # arguments this variant adds to the call

    def __init__(self) -> None:
        self._entry: Callable | None = None

    def entry(self) -> Callable:
        if self._entry is None:
            self._entry = _import_entry()
        return self._entry

    def availability(self, device: torch.device) -> Support:
        if device.type == "cpu" and not os.environ.get("KDA_AITER_SRC"):
            return Support.no("AITER's Triton kernels need a GPU (ROCm or CUDA)")
        try:
            parameters = inspect.signature(self.entry()).parameters
        except AiterMissing as exc:
            return Support.no(str(exc))
        missing = [p for p in self.needs if p not in parameters]
        if missing:
            return Support.no(f"this AITER's chunk_kimi_delta_attn has no {', '.join(missing)} parameter")
        return Support.yes()

    def markers(self, device: torch.device) -> tuple[str, ...]:
        return ("gfx950",) if gpu_arch(device) == "gfx950" else ()

    def standalone_source(self, case: Case) -> str:
        """A ``call`` that needs only torch and AITER (or its source, ``KDA_AITER_SRC``), for standalone repro
        files: this backend's path and segment length pinned as ``run`` pins them."""
        if self.segment is None:
            segment = f"os.environ.pop({SEGMENT_VARIABLE!r}, None)  # AITER's default segment length"
        else:
            segment = f"os.environ[{SEGMENT_VARIABLE!r}] = {str(self.segment)!r}"
        extra = "".join(f"{name}={value!r}, " for name, value in self.extra.items())
        return _STANDALONE.format(
            path="on" if self.flash_kda else "off",
            switches=FLASH_KDA_SWITCHES,
            flash_kda=self.flash_kda,
            segment=segment,
            before_call=self._standalone_before_call(case),
            admission=_STANDALONE_ADMISSION.format(safe_gate=case.safe_gate, checked=FLASH_KDA_CHECKED)
            if self.flash_kda
            else "",
            safe_gate=case.safe_gate,
            extra=extra,
        )

    def _standalone_before_call(self, case: Case) -> str:
        """Lines of the standalone ``call`` before the entry point, for what ``_arguments`` adds to the case's."""
        return ""

    def _arguments(self, inputs: KDAInputs) -> tuple[tuple, dict]:
        case = inputs.case
        kwargs = dict(inputs.kernel_kwargs())
        h0 = kwargs.pop("initial_state")
        kwargs.update(
            initial_state=None if h0 is None else h0.float(),  # older AITER takes an fp32 state only
            output_final_state=True,
            safe_gate=case.safe_gate,
            chunk_size=None,  # AITER's choice: 32 for FlashKDA, 64 for the default pipeline
            **self.extra,
        )
        return (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta), kwargs

    def _check_path(self, inputs: KDAInputs, kwargs: dict) -> None:
        if not self.flash_kda:
            return
        check = _flash_kda_predicate()
        if check is None:
            return
        accepted = check(
            q=inputs.q,
            v=inputs.v,
            chunk_size=32,
            safe_gate=kwargs["safe_gate"],
            **{name: kwargs[name] for name in FLASH_KDA_CHECKED},
        )
        if not accepted:
            raise Unsupported("AITER's flash_kda_supported refuses this call: it would run the default pipeline")

    def run(self, inputs: KDAInputs) -> BackendOutput:
        support = self.supports(inputs.case)
        if not support:
            raise Unsupported(support.reason)
        entry = self.entry()
        args, kwargs = self._arguments(inputs)
        self._check_path(inputs, kwargs)
        with torch.inference_mode(), _flash_kda(self.flash_kda, self.segment):
            o, final = entry(*args, **kwargs)
        return BackendOutput(o=o, final_state=stored(inputs.case, "final_state", final))


# FlashKDA as AITER's dispatcher admits calls (beyond it AITER runs the default pipeline): FlashKDA's own
# envelope with the safe gate and its range (AITER's flash_kda_supported); cases with checkpoints are taken,
# their states not returned.
AITER_FLASH_KDA = FLASH_KDA.narrowed(
    safe_gate=(True,), in_kernel_lower_bound=SAFE_LOWER_BOUND_RANGE, checkpoints=True, gate_dtypes=GATE_DTYPES
)


class AiterFlashKDA(AiterBackend):
    name = "aiter_flashkda"
    family = "AITER FlashKDA (Triton)"
    description = "AITER chunk_kimi_delta_attn, FlashKDA path, AITER's default segment length (depends on CU count)"
    flash_kda = True
    chunk_tokens = 32
    envelope = AITER_FLASH_KDA


class AiterFlashKDASeg16(AiterFlashKDA):
    name = "aiter_flashkda_seg16"
    description = "AITER FlashKDA with segments pinned to 16 chunks of 32 tokens (CHUNK_DELTA_ATTN_FLASH_KDA_SEG=16)"
    segment = 16


class AiterFlashKDAUnsegmented(AiterFlashKDA):
    name = "aiter_flashkda_unsegmented"
    description = "AITER FlashKDA with segmentation off (CHUNK_DELTA_ATTN_FLASH_KDA_SEG=0)"
    segment = 0


class AiterDefault(AiterBackend):
    name = "aiter_default"
    family = FLA_CHUNK_FAMILY
    scratch_bytes_per_token = staticmethod(fla_chunk_scratch_bytes_per_token)
    description = "AITER chunk_kimi_delta_attn, the FLA-derived default pipeline (FlashKDA switched off)"
    # Its intra-chunk inverse's dots are TF32 on NVIDIA by its own code, as FLA's are; its FlashKDA path pins
    # IEEE dots (flash_kda.py), so only the default pipeline declares TF32.
    working_precision = WorkingPrecision.tf32_on_nvidia(
        "ROCm/aiter e4048607a5 aiter/ops/triton/_triton_kernels/chunk_delta_attn/intra_attn.py lines 37-40 "
        "(SOLVE_TRIL_DOT_PRECISION = 'tf32' where IS_TF32_SUPPORTED, chunk_delta_attn_utils.py line 98: CUDA, "
        "compute capability 8 and up), its other float32 tl.dot calls at Triton's default (TF32 on NVIDIA)",
        "e4048607a5",
    )


class AiterNative(AiterBackend):
    name = "aiter_native"
    family = "AITER native (HIP)"
    description = "AITER chunk_kimi_delta_attn(backend='native'): the HIP FlashKDA port on gfx942/gfx950"
    needs = ("backend",)
    extra: ClassVar[dict[str, object]] = {"backend": "native"}
    flash_kda = True
    chunk_tokens = 16
    envelope = AITER_FLASH_KDA  # the native port's envelope is FlashKDA's

    def availability(self, device: torch.device) -> Support:
        arch = gpu_arch(device)
        if arch not in NATIVE_ARCHS:
            return Support.no(
                f"backend='native' runs on {' and '.join(NATIVE_ARCHS)} only, this device is {arch or device}"
            )
        return super().availability(device)

    def fit(self, case: Case) -> Case:
        return super().fit(case).replace(state_layout="v_first")

    def also_supports(self, case: Case) -> Support:
        if case.has_initial_state and not case.state_v_first:
            return Support.no("the native port takes a V-first initial state only")
        return Support.yes()

    def _standalone_before_call(self, case: Case) -> str:
        if case.gate != "lower_bound":
            return ""
        zeros = "torch.zeros(v.shape[2] * k.shape[3], device=q.device)  # the native port needs a dt_bias"
        return f'\n    if kwargs.get("dt_bias") is None:\n        kwargs["dt_bias"] = {zeros}'

    def _arguments(self, inputs: KDAInputs) -> tuple[tuple, dict]:
        args, kwargs = super()._arguments(inputs)
        if inputs.case.gate == "lower_bound" and inputs.dt_bias is None:
            kwargs["dt_bias"] = torch.zeros(inputs.case.num_v_heads * inputs.case.head_k_dim, device=inputs.device)
        return args, kwargs


class AiterPaged(AiterFlashKDA):
    name = "aiter_paged"
    description = (
        "AITER chunk_kimi_delta_attn's in-place paged API (out, state_cache, state_indices, has_initial_state)"
    )
    needs = ("out", "state_cache", "state_indices", "has_initial_state")
    # Its findings are the paged API's (a pool, an out buffer): the direct call's file would not reproduce them.
    standalone_source = None  # type: ignore[assignment]
    # The paged API takes an fp32 V-first state pool only.
    envelope = AITER_FLASH_KDA.narrowed(state_layouts=("v_first",), state_dtypes=("fp32",))

    def run_paged(
        self,
        batch: KDAInputs,
        pool: torch.Tensor,
        state_indices: torch.Tensor,
        has_initial_state: torch.Tensor,
        out: torch.Tensor,
        checkpoint_slots: torch.Tensor,
    ) -> None:
        """The server's call: AITER reads and writes ``pool`` in place and writes ``out``."""
        support = self.supports(batch.case)
        if not support:
            raise Unsupported(support.reason)
        if len(checkpoint_slots):
            raise Unsupported("AITER's paged API writes no checkpoint states")
        # AITER does not range-check state_indices: a PAD entry (-1) would wrap to the pool's last slot. The
        # glue hands it the real sequences only, as a server must.
        n = batch.case.num_seqs
        cu = batch.cu_seqlens
        if cu is not None and cu.numel() != n + 1:  # padding entries to drop; else the caller's object itself
            cu = cu[: n + 1]
        real = dataclasses.replace(batch, initial_state=None, cu_seqlens=cu)
        state_indices, has_initial_state = state_indices[:n], has_initial_state[:n]
        args, kwargs = self._arguments(real)
        # AITER wants ``out`` shaped like ``v`` (the token tensors, padded or not); the caller's buffer may be
        # longer: hand it as many rows.
        rows = out[:, : batch.v.shape[1]]
        kwargs.update(output_final_state=False, out=rows, state_cache=pool, state_indices=state_indices.to(torch.int32))
        kwargs.update(has_initial_state=has_initial_state)
        self._check_path(real, kwargs)
        with torch.inference_mode(), _flash_kda(True, self.segment):
            o, _ = self.entry()(*args, **kwargs)
        if o.data_ptr() != rows.data_ptr():
            rows.copy_(o)

    def run(self, inputs: KDAInputs) -> BackendOutput:
        """A plain call through the paged API: the states gathered into a pool of their own."""
        case = inputs.case
        HV, K, V, N = case.num_v_heads, case.head_k_dim, case.head_v_dim, case.num_seqs
        pool = torch.zeros((N + 1, HV, V, K), dtype=torch.float32, device=inputs.device)
        if inputs.initial_state is not None:
            pool[1:] = inputs.initial_state.float()
        out = torch.empty(inputs.v.shape, dtype=inputs.v.dtype, device=inputs.device)  # contiguous, as a layer's
        indices = torch.arange(1, N + 1, device=inputs.device)
        has = torch.full((N,), inputs.initial_state is not None, dtype=torch.bool, device=inputs.device)
        self.run_paged(inputs, pool, indices, has, out, torch.zeros(0, dtype=torch.int32, device=inputs.device))
        return BackendOutput(o=out, final_state=stored(case, "final_state", pool[1:]))


BACKENDS = (AiterFlashKDA, AiterFlashKDASeg16, AiterFlashKDAUnsegmented, AiterDefault, AiterNative, AiterPaged)
