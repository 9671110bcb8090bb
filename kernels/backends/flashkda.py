"""FlashKDA on CUDA (MoonshotAI/FlashKDA, the ``flash_kda`` package, a CUTLASS kernel for sm_90a), alone and as
FLA's ``chunk_kda`` hands calls to it when it is installed.

- ``flashkda_cuda``: ``flash_kda.fwd`` called as FlashKDA's README calls it: bf16 q, k, v, raw g and beta
  (q/k normalised, the lower-bound gate and beta's sigmoid inside), ``A_log`` fp32 ``[H]``, ``dt_bias`` fp32
  ``[H, K]``, an fp32 V-first state ``[N, H, V, K]``, int64 ``cu_seqlens``; it writes ``out`` and the final
  state in place.
- ``fla_chunk_dispatch``: what a Hopper user of ``fla.ops.kda.chunk_kda`` gets with ``flash_kda`` installed:
  FLA's own FlashKDA backend (``fla/ops/kda/backends/flash_kda.py``): its verifier decides, its adapter
  converts the arguments and calls ``flash_kda.fwd``. The suite imports FLA with its dispatch switched
  off (``kernels/backends/fla.py``), which leaves FLA's wrapper out; this backend runs the same verifier and adapter
  FLA's wrapper would. Calls the verifier rejects run FLA's Triton path, which ``fla_chunk`` tests: they
  are outside this backend's envelope, with the verifier's reason.

Their envelope is FlashKDA's own checks (``csrc/flash_kda.cpp``): bf16, K = V = 128, as many value heads as
key heads, the lower-bound gate with q/k normalisation and beta's sigmoid in the kernel; no checkpoints.
Building FlashKDA: docs/flashkda.md.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from kda_cases.case import Case
from kda_cases.dtypes import stored
from kda_cases.materialize import KDAInputs
from kda_kernels.backends.fla import FLA_ENVIRONMENT
from kda_kernels.envelope import FLASH_KDA
from kda_kernels.libraries import FLA, FLASHKDA
from kda_kernels.protocol import (
    CALLER_BUFFER_FILL,
    Backend,
    BackendOutput,
    Support,
    Unsupported,
    WorkingPrecision,
    relayout,
)

HEAD_DIM = 128
# FlashKDA's own checks (csrc/flash_kda.cpp), on CUDA only.
ENVELOPE = FLASH_KDA.narrowed(devices=("cuda",))
# FlashKDA's documented design: its recurrent state kept in bf16 on chip between the updates of its 16-token
# chunks (fp32 FMA for the update itself).
PRECISION = WorkingPrecision(
    state_dtype="bf16",
    chunk=16,
    source="MoonshotAI/FlashKDA docs/20260420-flashkda-v1-deep-dive.md, section 1 (CHUNK = 16) and section 3 "
    "(the on-chip recurrent state stored in bf16 between updates)",
)
INSTALL = "flash_kda is not installed (MoonshotAI/FlashKDA, built from source for sm_90a: docs/flashkda.md)"


def _availability(device: torch.device) -> Support:
    if device.type != "cuda" or not torch.cuda.is_available():
        return Support.no(f"FlashKDA is a CUDA kernel (sm_90a and later); this device is {device}")
    if torch.version.hip is not None:
        return Support.no("FlashKDA is a CUDA kernel; this is a ROCm build of torch (AITER ports it: aiter_flashkda)")
    major, _ = torch.cuda.get_device_capability(device)
    if major < 9:
        return Support.no(f"FlashKDA needs sm_90 or later; this GPU is sm_{major}x")
    if importlib.util.find_spec("flash_kda") is None:
        return Support.no(INSTALL)
    return Support.yes()


def _v_first_state(inputs: KDAInputs) -> torch.Tensor | None:
    # An fp32 V-first state, as a server's pool holds it (a bf16 pool is widened exactly).
    h0 = inputs.initial_state
    if h0 is None:
        return None
    return relayout(h0.float(), inputs.case.state_v_first, True).contiguous()


FAMILY = "FlashKDA (CUDA)"


# The standalone calls a repro file makes (conformance/repro/standalone_finding.py): flash_kda.fwd as FlashKDA's
# README calls it, and FLA's chunk_kda with its dispatch to FlashKDA on, each with torch and the package alone.
_STANDALONE_FWD = """

def call(q, k, v, g, beta, initial_state, cu_seqlens, scale=None, A_log=None, dt_bias=None, lower_bound=None,
         state_v_first=False, **unused):
    flash_kda = needs("flash_kda")  # skips naming FlashKDA where it is missing
    H, D = q.shape[2], q.shape[3]
    n = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
    out = torch.full(v.shape, float("nan"), dtype=v.dtype, device=v.device)  # the caller's buffer
    final = torch.empty(n, H, D, D, dtype=torch.float32, device=q.device)  # V-first, as a server's pool
    h0 = None
    if initial_state is not None:
        h0 = (initial_state.float() if state_v_first else initial_state.float().transpose(-1, -2)).contiguous()
    flash_kda.fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        D**-0.5 if scale is None else scale, out, A_log.float().contiguous(), dt_bias.float().view(H, D).contiguous(),
        float(lower_bound), initial_state=h0, final_state=final,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(torch.int64),
    )
    return out, final if state_v_first else final.transpose(-1, -2)
"""

_STANDALONE_DISPATCH = """

def call(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first=False, **kwargs):
    os.environ.pop("FLA_DISABLE_BACKEND_DISPATCH", None)  # FLA's chunk_kda as a Hopper user gets it
    needs("flash_kda")  # what FLA dispatches to: skip naming FlashKDA where it is missing
    kda = needs("fla.ops.kda")
    h0 = None
    if initial_state is not None:
        h0 = (initial_state.float() if state_v_first else initial_state.float().transpose(-1, -2)).contiguous()
    o, final = kda.chunk_kda(
        q, k, v, g, beta, initial_state=h0, cu_seqlens=cu_seqlens, output_final_state=True, safe_gate=True,
        state_v_first=True, **kwargs,
    )
    return o, final if state_v_first else final.transpose(-1, -2)
"""


class FlashKdaCuda(Backend):
    name = "flashkda_cuda"
    family = FAMILY
    description = "flash_kda.fwd, MoonshotAI's FlashKDA CUTLASS kernel (sm_90a), called as its README calls it"
    chunk_tokens = 16
    envelope = ENVELOPE
    working_precision = PRECISION
    libraries = (FLASHKDA,)

    def availability(self, device: torch.device) -> Support:
        return _availability(device)

    def standalone_source(self, case: Case) -> str:
        return _STANDALONE_FWD

    def run(self, inputs: KDAInputs) -> BackendOutput:
        support = self.supports(inputs.case)
        if not support:
            raise Unsupported(support.reason)
        import flash_kda

        case = inputs.case
        n = case.num_seqs if inputs.cu_seqlens is not None else inputs.q.shape[0]
        # The caller's buffer, as a server hands it: contiguous whatever v's layout (full_like would keep the
        # strides of a head-major v, which flash_kda.fwd refuses: "all tensors must be contiguous").
        out = torch.full(inputs.v.shape, CALLER_BUFFER_FILL, dtype=inputs.v.dtype, device=inputs.device)
        final = torch.empty(n, case.num_heads, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=inputs.device)
        cu = None if inputs.cu_seqlens is None else inputs.cu_seqlens.to(torch.int64)
        scale = case.scale if case.scale is not None else HEAD_DIM**-0.5
        # Its envelope takes only the in-kernel gate with a lower bound: A_log, dt_bias and the bound are given.
        assert inputs.A_log is not None and inputs.dt_bias is not None and case.lower_bound is not None
        with torch.inference_mode():
            flash_kda.fwd(
                inputs.q.contiguous(),
                inputs.k.contiguous(),
                inputs.v.contiguous(),
                inputs.g.contiguous(),
                inputs.beta.contiguous(),
                scale,
                out,
                inputs.A_log.float().contiguous(),
                inputs.dt_bias.float().view(case.num_heads, HEAD_DIM).contiguous(),
                float(case.lower_bound),
                initial_state=_v_first_state(inputs),
                final_state=final,
                cu_seqlens=cu,
            )
        final = stored(case, "final_state", relayout(final, True, case.state_v_first))
        return BackendOutput(o=out, final_state=final, o_in_caller_buffer=True)


def _fla_flash_kda(device: torch.device) -> Any:
    """FLA's FlashKDA backend object (fla-core's ``fla/ops/kda/backends/flash_kda.py``)."""
    from kda_kernels.backends.fla import _import_fla_kda  # FLA set up as the suite imports it for this device

    _import_fla_kda(device)
    try:
        from fla.ops.kda.backends.flash_kda import FlashKDABackend
    except ImportError as exc:
        raise Unsupported(f"this fla-core has no FlashKDA backend (fla.ops.kda.backends.flash_kda): {exc}") from exc
    return FlashKDABackend()


class FlaChunkDispatch(Backend):
    name = "fla_chunk_dispatch"
    family = FAMILY
    description = "fla.ops.kda.chunk_kda as dispatched to FlashKDA when flash_kda is installed (FLA's own adapter)"
    chunk_tokens = 16
    # FLA's verifier hands a call to FlashKDA only with the safe gate on (fla/ops/kda/backends/flash_kda.py)
    envelope = ENVELOPE.narrowed(safe_gate=(True,))
    working_precision = PRECISION
    libraries = (FLA, FLASHKDA)
    sets_environment = FLA_ENVIRONMENT

    def availability(self, device: torch.device) -> Support:
        if importlib.util.find_spec("fla") is None:
            return Support.no("fla-core is not installed (pip install fla-core==0.6.0)")
        return _availability(device)

    def standalone_source(self, case: Case) -> str:
        return _STANDALONE_DISPATCH

    def call_kwargs(self, inputs: KDAInputs) -> dict[str, Any]:
        """chunk_kda's arguments as a Hopper user passes them: the case's, with the fp32 state V-first."""
        kwargs = {**inputs.kernel_kwargs(), "initial_state": _v_first_state(inputs), "state_v_first": True}
        return {**kwargs, "output_final_state": True, "safe_gate": inputs.case.safe_gate}

    def run(self, inputs: KDAInputs) -> BackendOutput:
        support = self.supports(inputs.case)
        if not support:
            raise Unsupported(support.reason)
        backend = _fla_flash_kda(inputs.device)
        args = (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta)
        kwargs = self.call_kwargs(inputs)
        with torch.inference_mode():
            accepted, reason = backend.verify("chunk_kda", *args, **kwargs)
            if not accepted:  # FLA would run its Triton path: fla_chunk's
                raise Unsupported(f"FLA's dispatch would not hand this call to FlashKDA: {reason}")
            o, final = backend.get_implementation("chunk_kda")(*args, **kwargs)
        case = inputs.case
        return BackendOutput(o=o, final_state=stored(case, "final_state", relayout(final, True, case.state_v_first)))
