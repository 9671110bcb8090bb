"""Adapters for FLA's KDA kernels (fla-core): the Triton chunk pipeline and the recurrent kernel.

``FLA_DISABLE_BACKEND_DISPATCH=1`` is forced before FLA is imported: otherwise
``chunk_kda`` silently hands suitable calls to FlashKDA when that package is
installed, and the Triton path would not be what is tested. On a CPU the
kernels run in Triton's interpreter (``kernels/triton_interpret.py``).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
from types import ModuleType

import torch

from kda_cases.case import Case
from kda_cases.dtypes import stored
from kda_cases.envelope import Envelope
from kda_cases.materialize import KDAInputs
from kda_kernels import triton_interpret
from kda_kernels.backward import autograd_backward
from kda_kernels.envelope import CHUNK_KDA, MAX_HEAD_K_DIM
from kda_kernels.libraries import FLA
from kda_kernels.protocol import Backend, BackendOutput, Support, Unsupported, WorkingPrecision
from kda_reference.gradients import Gradients

# What importing and calling FLA sets in the environment (Backend.sets_environment): the suite's switch to
# its Triton path, the interpreter on a CPU, and the fp32 dot precision fla/utils/hardware.py sets at import
# on NVIDIA cards without TF32.
FLA_ENVIRONMENT = ("FLA_DISABLE_BACKEND_DISPATCH", triton_interpret.VARIABLE, "TRITON_F32_DEFAULT")


# FLA's chunk kernels and every copy of them (AITER's default pipeline, vLLM's, SGLang's): one lineage.
FLA_CHUNK_FAMILY = "FLA chunk (Triton)"


def fla_chunk_scratch_bytes_per_token(case: Case) -> int:
    """What FLA's chunk forward (and every copy of it) allocates per token beyond its inputs, output and states:
    per value head, the gate's float32 cumulative sum, the normalized q and k, w, u, the gated k and the new v
    (about 8 x (K + V) bytes together), and two float32 64-wide blocks of the intra-chunk matrices (512 bytes).
    With the plan's float32 state per 64 tokens that is 1,792 and 3,584 bytes per token and head at K = V = 64
    and 128, where fla-core 0.6.0 allocated 1,608 and 3,144 (tests/scratch_probe.py, in the Triton
    interpreter; on an H100 the 2^31 batch of H8/8 K = V = 128 bf16 wanted at least 80.6 GiB, the old plan's
    52.1)."""
    return case.num_v_heads * (8 * (case.head_k_dim + case.head_v_dim) + 2 * 64 * 4)


# FLA's chunk pipeline chooses TF32 for its float32 matmuls on NVIDIA Ampere and later, in its own code: the
# intra-chunk inverse's dots by a hard-coded precision that TRITON_F32_DEFAULT cannot reach, its other float32
# dots (every dot of an fp32 call) at Triton's default, TF32. Its recurrent kernel has no dots.
TF32_DOTS = WorkingPrecision.tf32_on_nvidia(
    "fla-core 0.6.0 fla/ops/kda/chunk_intra.py lines 22-25 (SOLVE_TRIL_DOT_PRECISION = tl.constexpr('tf32') "
    "if IS_TF32_SUPPORTED, fla/utils/hardware.py line 111: NVIDIA, compute capability 8 and up; since FLA PR #703, "
    "commit d1097c60, v0.4.2), its other float32 tl.dot calls at Triton's default (TF32 on NVIDIA)",
    "0.6.0",
)


def _import_fla_kda(device: torch.device) -> ModuleType:
    """Import ``fla.ops.kda`` set up for ``device``: interpreter on a CPU, compiled on a GPU."""
    if device.type == "cpu":
        triton_interpret.enable()
    elif triton_interpret.interpreting():
        raise RuntimeError(f"TRITON_INTERPRET is set, so FLA cannot run compiled on {device}; unset it for GPU runs")
    os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "1"
    import fla.backends
    import fla.ops.kda

    fla.backends._DISPATCH_DISABLED = True  # in case FLA was imported before we set the variable
    if device.type == "cpu":
        triton_interpret.patch_fla()
    return fla.ops.kda


def _fla_availability(device: torch.device) -> Support:
    if importlib.util.find_spec("fla") is None:
        return Support.no("fla-core is not installed (pip install fla-core==0.6.0)")
    if device.type == "cpu":
        problem = triton_interpret.problem()
        return Support.no(problem) if problem else Support.yes()
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return Support.no("no CUDA/ROCm device is visible to torch")
        if triton_interpret.interpreting():
            return Support.no("TRITON_INTERPRET is set in this process, so Triton cannot compile for the GPU")
        return Support.yes()
    return Support.no(f"FLA's Triton kernels do not run on device type {device.type!r}")


def _state_for_kernel(inputs: KDAInputs) -> torch.Tensor | None:
    # FLA takes an fp32 state only; a bf16 pool is widened exactly, as serving glue does.
    h0 = inputs.initial_state
    return None if h0 is None else h0.float()


_STANDALONE = """

def call(q, k, v, g, beta, initial_state, cu_seqlens, **kwargs):
    os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "1"  # the Triton path itself, not a dispatch to FlashKDA
    kda = needs("fla.ops.kda")  # skips naming what is missing: fla-core, or a module it imports
    return kda.{function}(
        q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, output_final_state=True, {extra}**kwargs
    )
"""


class FlaChunk(Backend):
    name = "fla_chunk"
    description = "fla.ops.kda.chunk_kda, the Triton chunk pipeline (dispatch to FlashKDA disabled)"
    envelope = CHUNK_KDA.narrowed(host_metadata=("cu_seqlens_cpu",), backward=True)
    libraries = (FLA,)
    sets_environment = FLA_ENVIRONMENT
    working_precision = TF32_DOTS
    family = FLA_CHUNK_FAMILY
    scratch_bytes_per_token = staticmethod(fla_chunk_scratch_bytes_per_token)

    def __init__(self, chunk_size: int = 64) -> None:
        if chunk_size not in (32, 64):
            raise ValueError(f"chunk_size must be 32 or 64 for FLA's chunk_kda, got {chunk_size}")
        self.chunk_size = self.chunk_tokens = chunk_size
        if chunk_size != 64:
            self.name = f"fla_chunk{chunk_size}"
        self.chunk_variants = ("fla_chunk32",) if chunk_size == 64 else ("fla_chunk",)

    def availability(self, device: torch.device) -> Support:
        return _fla_availability(device)

    def interpreted(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def standalone_source(self, case: Case) -> str:
        """A ``call`` that needs only torch and fla-core, for standalone repro files (on a GPU)."""
        return _STANDALONE.format(
            function="chunk_kda", extra=f"safe_gate={case.safe_gate}, chunk_size={self.chunk_size}, "
        )

    def host_metadata(self, device: torch.device, cu_seqlens_cpu: torch.Tensor) -> dict[str, torch.Tensor]:
        accepted = inspect.signature(_import_fla_kda(device).chunk_kda).parameters
        return {"cu_seqlens_cpu": cu_seqlens_cpu.long()} if "cu_seqlens_cpu" in accepted else {}

    def run(self, inputs: KDAInputs) -> BackendOutput:
        support = self.supports(inputs.case)
        if not support:
            raise Unsupported(support.reason)
        kda = _import_fla_kda(inputs.device)
        kwargs = {**inputs.kernel_kwargs(), **(inputs.host_metadata or {})}
        kwargs["initial_state"] = _state_for_kernel(inputs)
        with torch.inference_mode():
            o, final = kda.chunk_kda(
                inputs.q,
                inputs.k,
                inputs.v,
                inputs.g,
                inputs.beta,
                output_final_state=True,
                safe_gate=inputs.case.safe_gate,
                chunk_size=self.chunk_size,
                **kwargs,
            )
        return BackendOutput(o=o, final_state=stored(inputs.case, "final_state", final))

    def run_backward(self, inputs: KDAInputs, d_o: torch.Tensor, d_final: torch.Tensor | None) -> Gradients:
        """chunk_kda's own backward (``ChunkKDAFunction.backward``), through autograd."""
        support = self.supports(inputs.case)
        if not support:
            raise Unsupported(support.reason)
        kda = _import_fla_kda(inputs.device)
        call = functools.partial(
            kda.chunk_kda, output_final_state=True, safe_gate=inputs.case.safe_gate, chunk_size=self.chunk_size
        )
        return autograd_backward(inputs, d_o, d_final, call, {**inputs.kernel_kwargs(), **(inputs.host_metadata or {})})


class FlaRecurrent(Backend):
    name = "fla_recurrent"
    family = "FLA recurrent (Triton)"
    description = "fla.ops.kda.fused_recurrent_kda, the per-token Triton kernel with an fp32 state"
    chunk_tokens = 1
    envelope = Envelope(max_head_k_dim=MAX_HEAD_K_DIM)  # no range check of the safe gate's bound
    libraries = (FLA,)
    sets_environment = FLA_ENVIRONMENT

    def availability(self, device: torch.device) -> Support:
        return _fla_availability(device)

    def interpreted(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def standalone_source(self, case: Case) -> str:
        """A ``call`` that needs only torch and fla-core, for standalone repro files (on a GPU)."""
        return _STANDALONE.format(function="fused_recurrent_kda", extra="")

    def run(self, inputs: KDAInputs) -> BackendOutput:
        support = self.supports(inputs.case)
        if not support:
            raise Unsupported(support.reason)
        kda = _import_fla_kda(inputs.device)
        kwargs = inputs.kernel_kwargs()
        kwargs["initial_state"] = _state_for_kernel(inputs)
        with torch.inference_mode():
            o, final = kda.fused_recurrent_kda(
                inputs.q,
                inputs.k,
                inputs.v,
                inputs.g,
                inputs.beta,
                output_final_state=True,
                **kwargs,
            )
        return BackendOutput(o=o, final_state=stored(inputs.case, "final_state", final))
