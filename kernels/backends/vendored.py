"""Backends for the copies of FLA's KDA Triton kernels that servers vendor: vLLM's and SGLang's.

Each is loaded from a source tree the user names, without installing the server (kernels/vendored_trees.py:
``KDA_VLLM_SRC``, ``KDA_SGLANG_SRC``, the stubs of the few server modules the kernels import).

What the server's layer does around the call is reproduced, read from its code (docs/serving.md), in
kernels/server_layers.py (vLLM's Kimi layer, GLM-5.3-Flash's, SGLang's ``TritonKDAKernel.extend``), which a
standalone repro file carries verbatim; here, what the suite adds around it: the layer's output buffer
checked outside its slice, the envelope each tree's signatures allow.

Which entry points and arguments exist is found from the signatures, never from a version. The state
layout the kernels use (V-first in current trees, K-first in older ones) is found by one small probe call
with K != V. The commit of the tree is recorded in the run's environment (``env_source_trees``).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Callable

import torch

from kda_cases.case import GATES, Case
from kda_cases.dtypes import stored
from kda_cases.envelope import Envelope
from kda_cases.materialize import KDAInputs
from kda_kernels import libraries as libs
from kda_kernels import server_layers, server_stubs, triton_interpret
from kda_kernels.backends.fla import FLA_CHUNK_FAMILY, fla_chunk_scratch_bytes_per_token
from kda_kernels.envelope import CHUNK_KDA
from kda_kernels.guard import suite_work
from kda_kernels.protocol import (
    CALLER_BUFFER_FILL,
    Backend,
    BackendOutput,
    Support,
    Unsupported,
    WorkingPrecision,
    relayout,
)
from kda_kernels.vendored_trees import (
    SGLANG,
    VLLM,
    VLLM_GLM5,
    VLLM_GLM5_AMD,
    VLLM_KIMI_AMD,
    Tree,
    VendoredMissing,
    _block_pointer_modules,
    load,
    stub_gaps,
)


def _layer_inputs(inputs: KDAInputs) -> server_layers.LayerInputs:
    """The tensors the layers' calls take (kernels/server_layers.py)."""
    return server_layers.LayerInputs(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, inputs.A_log,
                                     inputs.dt_bias, inputs.initial_state, inputs.cu_seqlens)  # fmt: skip


# A standalone repro file's call of a server's kernels (conformance/repro/standalone_finding.py), after the
# loader (kernels/server_stubs.py) and the layers' calls (kernels/server_layers.py) it carries verbatim.
_STANDALONE = """

TREE = {tree!r}  # (the variable naming a source tree, the top package, where kda.py lives newest first, bare packages)


def kda_module():
    # {server}'s KDA kernels: from the source tree {variable} names, loaded as kda-conformance loads it (its
    # packages bare, the server modules its kernels import stubbed: import_kda above), else the installed {server}'s.
    variable, package, modules, bare = TREE
    root = os.environ.get(variable)
    if root:
        return import_kda(Path(root), package, modules, bare)
    for module in modules:
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == package:
                break
            if not (exc.name and module.startswith(exc.name)):  # not another layout's folder: something it imports
                return needs(module)
    pytest.skip("needs {server} with its KDA kernels (pip install {package}), or its source tree named by {variable}")


def call(q, k, v, g, beta, initial_state, cu_seqlens, **kwargs):
    kda = kda_module()
    options = layer_options(CASE)  # the case's options, as the layer hands them
    with torch.inference_mode():
        v_first = probe_v_first({prefill}, kda, q.device, options)  # the layout the kernels keep states in
        x = LayerInputs(q, k, v, g, beta, kwargs["A_log"], kwargs["dt_bias"], initial_state, cu_seqlens)
        o, final = {prefill}(kda, x, options, v_first{extra})
    return o, final if v_first == CASE.state_v_first else final.transpose(-1, -2)
"""


class VendoredBackend(Backend):
    """Common ground: loading the tree, availability on the device, the envelope the server's layer has."""

    family = FLA_CHUNK_FAMILY  # every server's copy is FLA's chunk kernels
    scratch_bytes_per_token = staticmethod(fla_chunk_scratch_bytes_per_token)

    tree: Tree
    chunk_tokens = 64
    sets_environment = (triton_interpret.VARIABLE,)  # availability on a CPU enables the interpreter
    # The server's entry points, any one of which the backend can call (a tree with none is unavailable).
    entry_points: tuple[str, ...] = ("chunk_kda",)
    # How the server's layer calls them (kernels/server_layers.py): (kda, tensors, v_first=, options) -> (o, final).
    prefill: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # The probe call that finds the kernels' state layout (K != V): a gate the entry point takes.
    probe_gate: str = "log"
    # The server's KDA layer: as many value heads as key heads, no intermediate states saved. Where the tree
    # loads, ``envelope`` narrows this to the gates its entry points take.
    # Gates arrive in float32 as the servers' layers hand them (``g.float()``, ``beta.float()`` below): a case's
    # float32 gate reaches the kernels unrounded, one in the tokens' dtype exactly.
    declared = CHUNK_KDA.narrowed(in_kernel_lower_bound=None, gva=False, checkpoints=False)

    @property
    def envelope(self) -> Envelope:  # type: ignore[override]
        try:
            refused = self.refused_gates()
        except VendoredMissing:
            return self.declared
        gates = tuple(g for g in self.declared.gates if g not in refused)
        return self.declared.narrowed(gates=gates) if gates else self.declared

    def refused_gates(self) -> dict[str, str]:
        """The gate forms the loaded tree's entry points do not take, with why."""
        return {}

    def supports(self, case: Case) -> Support:
        refused = self.refused_gates().get(case.gate)  # the tree's own reason, before the envelope's words
        return Support.no(refused) if refused else super().supports(case)

    def kda(self) -> types.ModuleType:
        return load(self.tree)

    def availability(self, device: torch.device) -> Support:
        try:
            self.tree.root()
        except VendoredMissing as exc:
            return Support.no(str(exc))
        if device.type == "cpu":
            problem = triton_interpret.problem()
            if problem:
                return Support.no(problem)
            triton_interpret.enable()
        elif device.type != "cuda" or not torch.cuda.is_available():
            return Support.no(f"{self.tree.server}'s Triton kernels do not run on {device}")
        try:
            kda = self.kda()
        except VendoredMissing as exc:
            return Support.no(str(exc))
        missing = [name for name in self.entry_points if not hasattr(kda, name)]
        if len(missing) == len(self.entry_points):  # the tree is another version's: say what it lacks
            return Support.no(f"this {self.tree.server} tree's {kda.__name__} has no {' nor '.join(missing)}")
        gap = _interpreter_gap(self) if device.type == "cpu" else ""
        return Support.no(gap) if gap else Support.yes()

    def interpreted(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def kernel_v_first(self, device: torch.device) -> bool:
        """Whether the kernels keep the state V-first, found once by a probe call with K = 16, V = 32."""
        return _probe_layout(self, device.type)

    def call(self, inputs: KDAInputs, v_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The server's prefill call with the states in the given layout: (o, final state in that layout)."""
        return self.prefill(self.kda(), _layer_inputs(inputs), server_layers.layer_options(inputs.case), v_first)

    def run(self, inputs: KDAInputs) -> BackendOutput:
        support = self.supports(inputs.case)
        if not support:
            raise Unsupported(support.reason)
        with stub_gaps():
            self.before_calls(inputs.device)
            v_first = self.kernel_v_first(inputs.device)
            with torch.inference_mode():
                o, final = self.call(inputs, v_first)
        final = relayout(final, v_first, inputs.case.state_v_first)
        return BackendOutput(o=o, final_state=stored(inputs.case, "final_state", final))

    def before_calls(self, device: torch.device) -> None:
        """What the server sets up before its layers call the kernels (nothing, for most)."""

    standalone_modules = (server_stubs, server_layers)

    def standalone_source(self, case: Case) -> str:
        """A ``call`` that needs only torch and the server (installed, or its source tree), for standalone repro
        files: the layer's call of kernels/server_layers.py, the layout found by its probe."""
        tree = (self.tree.variable, self.tree.package, self.tree.modules, self.tree.bare)
        name = self.prefill.__name__
        extra = self.standalone_extra()
        return _STANDALONE.format(tree=tree, server=self.tree.server, variable=self.tree.variable, prefill=name,
                                  package=self.tree.package, extra=f", {extra}" if extra else "")  # fmt: skip

    def standalone_extra(self) -> str:
        """The call's further arguments, as source (the file's names: q, v, cu_seqlens, kda)."""
        return ""


_LAYOUTS: dict[tuple[Tree, str], bool] = {}


def _probe_layout(backend: VendoredBackend, device_type: str) -> bool:
    """The layout the kernels keep their states in (server_layers.probe_v_first), kept per tree and device type."""
    key = (backend.tree, device_type)
    if key not in _LAYOUTS:
        bounded = GATES[backend.probe_gate].bound == "required"
        case = Case(seq_lens=(3,), num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=32, gate=backend.probe_gate,
                    lower_bound=-5.0 if bounded else None, safe_gate=bounded)  # fmt: skip
        options = server_layers.layer_options(case)
        with stub_gaps():
            try:
                found = server_layers.probe_v_first(backend.prefill, backend.kda(), torch.device(device_type), options)
            except server_layers.UnknownLayout as exc:
                raise Unsupported(f"{backend.tree.server}'s {exc}") from exc
        _LAYOUTS[key] = found
    return _LAYOUTS[key]


_GAPS: dict[Tree, str] = {}


def _interpreter_gap(backend: VendoredBackend) -> str:
    """Why Triton's CPU interpreter cannot run the tree's kernels, or '': block pointers, which the pinned
    Triton's interpreter refuses, or the interpreter's own error on the layout probe. It is this machine's
    limit, not the kernel's bug: the backend is unavailable here instead of an error charged to the kernel.
    Kept per tree (it reads the kernels' sources and makes a kernel call)."""
    key, triton = backend.tree, f"triton=={triton_interpret.PINNED_TRITON}"
    if key not in _GAPS:
        uses = _block_pointer_modules(backend.tree.root())
        if uses:
            _GAPS[key] = (
                f"{backend.tree.server}'s kernels use tl.make_block_ptr ({', '.join(uses)}), which Triton's CPU "
                f"interpreter ({triton}) no longer runs; run them on a GPU"
            )
            return _GAPS[key]
        try:
            backend.kernel_v_first(torch.device("cpu"))
            _GAPS[key] = ""
        except Exception as exc:
            if type(exc).__name__ != "InterpreterError":
                raise
            _GAPS[key] = (
                f"Triton's CPU interpreter ({triton}) cannot run {backend.tree.server}'s kernels: the layout probe "
                f"failed in it ({f'{exc}'[:300]}); run them on a GPU"
            )
    return _GAPS[key]


def forget(tree: Tree) -> None:
    """Drop what was loaded from ``tree`` (its modules, stubs and layout), so another tree can be loaded."""
    for name in [m for m in sys.modules if m == tree.package or m.startswith(tree.package + ".")]:
        del sys.modules[name]
    for key in [k for k in _LAYOUTS if k[0].package == tree.package]:
        del _LAYOUTS[key]
    for key in [k for k in _GAPS if k.package == tree.package]:
        del _GAPS[key]
    load.cache_clear()


# Rows of the layer's output buffer on each side of the slice a kernel is handed with ``out=``: the other
# tokens' rows of a mixed batch (speculative decode beside the prefill).
OUT_MARGIN = 3


def layer_output_slice(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi K3's layer hands its prefill kernel ``out=core_attn_out[:, non_spec_slice]``: a contiguous run of
    rows, at an offset, of the layer's token buffer, which is ``torch.empty`` (stale memory). Here that buffer
    holds CALLER_BUFFER_FILL, so a row the kernel leaves unwritten shows in its output; returns (the buffer,
    the slice shaped as v). The layer's batch is one packed row; a batch of several rows gets one contiguous
    slice of B x T rows (the layer passes no strided out=)."""
    B, T = v.shape[:2]
    buffer = torch.full((B * T + 2 * OUT_MARGIN, *v.shape[2:]), CALLER_BUFFER_FILL, dtype=v.dtype, device=v.device)
    return buffer, buffer[OUT_MARGIN : OUT_MARGIN + B * T].view(v.shape)


def check_outside_the_slice(buffer: torch.Tensor, rows: int) -> None:
    """The rows around the slice belong to other tokens: a kernel that writes them breaks its call."""
    outside = torch.cat([buffer[:OUT_MARGIN], buffer[OUT_MARGIN + rows :]])
    written = int((~outside.isnan()).any(dim=tuple(range(1, outside.dim()))).sum())
    if written:
        raise RuntimeError(
            f"wrote {written} rows of the layer's output buffer outside the out= slice it was handed (other "
            f"tokens' rows of a mixed batch; {OUT_MARGIN} on each side)"
        )


class VllmChunk(VendoredBackend):
    name = "vllm_chunk"
    description = "vLLM's vendored KDA chunk kernels (KDA_VLLM_SRC), called as vLLM's KDA layer calls them"
    tree = VLLM
    libraries = (libs.VLLM,)
    # Kimi K3's NVIDIA copy (FLA 0.5.0's kernels, adapted) chooses TF32 for its inverse on CUDA in its own code.
    # GLM-5.3-Flash's copies state IEEE (DOT_PRECISION="ieee", allow_tf32=False) and declare nothing: their
    # TF32 at Triton's default is a finding. The AMD copy runs only on ROCm, where it chooses IEEE.
    working_precision = WorkingPrecision.tf32_on_nvidia(
        "vllm 0.33.0 vllm/models/kimi_k3/nvidia/ops/third_party/kda/chunk_intra.py (solve_tril_dot_precision "
        '= "tf32" if current_platform.is_cuda() and current_platform.has_device_capability(80) else "ieee", '
        '"we used tf32 to maintain matrix inverse\'s precision whenever possible"), its other float32 tl.dot calls '
        "at Triton's default (TF32 on NVIDIA)",
        "0.33.0",
    )
    entry_points = ("chunk_kda_with_fused_gate", "chunk_kda")
    prefill = staticmethod(server_layers.vllm_prefill)

    def standalone_extra(self) -> str:
        # The layer's output buffer is torch.empty: NaN here, so a row the kernel leaves unwritten shows.
        return 'out=torch.full_like(v, float("nan"))'

    def _fused_parameters(self) -> set[str]:
        fused = getattr(self.kda(), "chunk_kda_with_fused_gate", None)
        return server_layers.parameters(fused) if fused is not None else set()

    def refused_gates(self) -> dict[str, str]:
        if "lower_bound" in self._fused_parameters():
            return {}
        return {"lower_bound": "this vLLM tree's KDA gate is -exp(A_log) * softplus(g + dt_bias): no lower-bound gate"}

    def also_supports(self, case: Case) -> Support:
        if case.gate_in_kernel and "raw_beta" in self._fused_parameters() and not case.beta_sigmoid_in_kernel:
            return Support.no("this vLLM tree's fused-gate KDA takes beta raw (its sigmoid inside the kernel)")
        return Support.yes()

    def _into_layer_buffer(self, case: Case) -> bool:
        """Whether the call hands the kernel a slice of the layer's output buffer (``out=``), as Kimi K3's
        layer does where the fused-gate entry takes it: the output is then read from that buffer."""
        return case.gate_in_kernel and "out" in self._fused_parameters()

    def run(self, inputs: KDAInputs) -> BackendOutput:
        result = super().run(inputs)
        return dataclasses.replace(result, o_in_caller_buffer=self._into_layer_buffer(inputs.case))

    def fit(self, case: Case) -> Case:
        fitted = super().fit(case)
        if fitted.gate_in_kernel and not fitted.beta_sigmoid_in_kernel and "raw_beta" in self._fused_parameters():
            return fitted.replace(beta_sigmoid_in_kernel=True)  # the layer hands beta raw to the kernel
        return fitted

    def call(self, inputs: KDAInputs, v_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's prefill call with the states in the given layout: (o, final state in that layout)."""
        buffer, out = layer_output_slice(inputs.v) if self._into_layer_buffer(inputs.case) else (None, None)
        options = server_layers.layer_options(inputs.case)
        try:
            o, final = self.prefill(self.kda(), _layer_inputs(inputs), options, v_first, out=out)
        except NotImplementedError as exc:  # the tree has no entry for the case's gate form
            raise Unsupported(str(exc)) from exc
        if buffer is not None and out is not None:
            with suite_work(self):  # its read of the buffer is the suite's sync, not vLLM's
                check_outside_the_slice(buffer, out.shape[0] * out.shape[1])
        return o, final


class SglangChunk(VendoredBackend):
    name = "sglang_chunk"
    description = "SGLang's vendored KDA chunk kernels (KDA_SGLANG_SRC), called as SGLang's TritonKDAKernel calls them"
    tree = SGLANG
    libraries = (libs.SGLANG,)
    prefill = staticmethod(server_layers.sglang_prefill)
    working_precision = WorkingPrecision.tf32_on_nvidia(
        "sglang 0.5.23 sglang/kernels/ops/attention/fla/chunk_intra.py (SOLVE_TRIL_DOT_PRECISION 'tf32' if "
        "is_tf32_supported, fla/utils.py: NVIDIA, compute capability 8 and up; kda.py passes DOT_PRECISION='tf32' "
        "to recompute_w_u), its other float32 tl.dot calls at Triton's default (TF32 on NVIDIA)",
        "0.5.23",
    )

    def _takes_graph_tables(self) -> bool:
        try:
            return server_layers.sglang_takes_graph_tables(self.kda())
        except VendoredMissing:
            return False

    @property
    def envelope(self) -> Envelope:  # type: ignore[override]
        envelope = super().envelope
        if not self._takes_graph_tables():
            return envelope
        # SGLang captures this call in its prefill CUDA graph (kda_prefill_graph.py), handing it these tables.
        return envelope.narrowed(host_metadata=server_layers.GRAPH_CHUNK_METADATA, graph_capture=True)

    def host_metadata(self, device: torch.device, cu_seqlens_cpu: torch.Tensor) -> dict[str, torch.Tensor]:
        return server_layers.graph_chunk_tables(cu_seqlens_cpu, device) if self._takes_graph_tables() else {}

    def refused_gates(self) -> dict[str, str]:
        kda = self.kda()
        takes = server_layers.parameters(kda.chunk_kda)
        refused = {}
        if "A_log" not in takes and not hasattr(kda, "fused_kda_gate"):
            why = "this SGLang tree's chunk_kda takes no A_log and it has no fused_kda_gate"
            refused = {name: why for name, form in GATES.items() if form.in_kernel}
        if "lower_bound" not in takes:
            refused["lower_bound"] = "this SGLang tree's chunk_kda takes no lower_bound (safe gate)"
        return refused

    def call(self, inputs: KDAInputs, v_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """SGLang's prefill call with the states in the given layout: (o, final state in that layout)."""
        options = server_layers.layer_options(inputs.case)
        return self.prefill(self.kda(), _layer_inputs(inputs), options, v_first, host_metadata=inputs.host_metadata)

    def kernel_v_first(self, device: torch.device) -> bool:
        if "initial_state_indices" in server_layers.parameters(self.kda().chunk_kda):
            return True  # the pool API: V-first slots (the kernel's block pointers read state[v, k])
        return super().kernel_v_first(device)


class VllmKimiChunkAmd(VllmChunk):
    name = "vllm_kimi_chunk_amd"
    description = "vLLM 0.33's Kimi K3 AMD copy (vllm/models/kimi_k3/amd), Triton, called as the Kimi layer calls it"
    tree = VLLM_KIMI_AMD
    working_precision = None  # it chooses TF32 on CUDA only, and runs on ROCm only
    # Its calls need the Triton allocator vLLM sets (before_calls), which the standalone call does not carry.
    standalone_source = None  # type: ignore[assignment]

    def availability(self, device: torch.device) -> Support:
        if device.type == "cuda" and torch.version.hip is None:
            # On an H200 (docs/results/), with Triton's allocator set as vLLM sets it, its first kernel
            # stops with "an illegal instruction was encountered" (it builds tensor descriptors on the device,
            # written for ROCm). Not the suite's error, nor a bug of a kernel vLLM runs on ROCm only.
            return Support.no("vLLM's Kimi K3 AMD copy does not run on NVIDIA GPUs (an illegal instruction on an "
                              "H200); it runs on ROCm")  # fmt: skip
        return super().availability(device)

    def before_calls(self, device: torch.device) -> None:
        if device.type == "cuda":
            # Its kernels build tensor descriptors on the device (tl.make_tensor_descriptor), which Triton on
            # NVIDIA backs with global scratch memory from an allocator; vLLM's own set_triton_allocator
            # (vllm/triton_utils/allocation.py) hands it plain device memory, as here. It changes no number.
            import triton

            triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device=device, dtype=torch.int8))


class VllmGlm5Chunk(VendoredBackend):
    """GLM-5.3-Flash's prefill as vLLM 0.33 serves it on CUDA with the Triton backend (glm5next/common/kda.py
    ``Glm5NextLinearAttention``): ``chunk_kda_with_fused_gate`` with q, k, v ``[1, T, H, D]``, the raw gate,
    beta sigmoided in fp32 before the call, ``A_log`` as the layer's ``[1, 1, H, 1]`` fp32 parameter,
    ``g_bias`` its fp32 ``dt_bias`` ``[H * D]``, the safe gate always on with the model's lower bound, q/k
    normalised in the kernel, every sequence's V-first fp32 state gathered from the pool (zeros for a fresh
    one) and the final states scattered back; the output lands in v's buffer."""

    name = "vllm_glm5_chunk"
    description = "vLLM 0.33's GLM-5.3-Flash NVIDIA copy (vllm/models/glm5next/nvidia), called as its layer calls it"
    tree = VLLM_GLM5
    libraries = (libs.VLLM,)
    entry_points = ("chunk_kda_with_fused_gate",)
    prefill = staticmethod(server_layers.glm5_prefill)
    probe_gate = "lower_bound"
    # The layer: one head size for K and V, as many value heads as key heads, the safe lower-bound gate from
    # the raw projection, q/k normalised in the kernel; no intermediate states.
    declared = Envelope(
        max_head_k_dim=256,
        equal_head_dims=True,
        gva=False,
        gates=("lower_bound",),
        safe_gate=(True,),
        l2norm_in_kernel=(True,),
        checkpoints=False,
        gate_dtypes=("same",),  # the layer's raw gate is its projection's output, in the tokens' dtype
    )


class VllmGlm5ChunkAmd(VllmGlm5Chunk):
    name = "vllm_glm5_chunk_amd"
    description = "vLLM 0.33's GLM-5.3-Flash AMD copy (vllm/models/glm5next/amd), its Triton run wherever Triton runs"
    tree = VLLM_GLM5_AMD
