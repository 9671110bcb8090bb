"""Planted backward bugs: the baseline (its forward correct) with one gradient wrong as a real KDA backward gets
it wrong, one per gradient the gradients check holds (tests/test_gradients.py requires each caught and named).

- dq without the attention scale: the chain rule through ``q * scale`` dropped.
- dk with the last token of every 64-token chunk left zero: a tile mask off by one.
- dv of the final partial chunk of the last sequence never written (zeros where ``torch.empty`` would leave
  garbage): a grid that skips the tail chunk.
- dg as the gradient of the cumulative log decay, its reverse cumulative sum within each chunk forgotten.
- dbeta without the derivative of beta's sigmoid (where the kernel applies it).
- dh0 never written: the initial state's gradient left zero.
- dA_log without the factor exp(A_log) of the softplus gate's chain rule.
- ddt_bias summed over the first sequence only: a reduction over packed sequences with the wrong offsets (FLA
  #1115's class).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kda_cases.dtypes import GRADIENT_TENSORS, TORCH_DTYPES, stored_dtype
from kda_cases.materialize import KDAInputs
from kda_kernels.registry import register
from kda_kernels.torch_chunk import TorchChunk
from kda_reference.gradients import Gradients, kda_gradients

# name -> (the bug it models, the gradient it breaks)
BACKWARD_ZOO: dict[str, tuple[str, str]] = {}
CHUNK = 64


def planted_backward(name: str, models: str, gradient: str) -> Callable[[Callable], type[TorchChunk]]:
    """Register the baseline with ``wrong(inputs, gradients, d_o, d_final) -> Gradients`` applied to its backward."""

    def wrap(wrong: Callable[[KDAInputs, Gradients], Gradients]) -> type[TorchChunk]:
        class Planted(TorchChunk):
            def run_backward(self, inputs: KDAInputs, d_o: torch.Tensor, d_final: torch.Tensor | None) -> Gradients:
                return wrong(inputs, super().run_backward(inputs, d_o, d_final))

        Planted.name, Planted.description = name, models
        BACKWARD_ZOO[name] = (models, gradient)
        register(name, Planted)
        return Planted

    return wrap


def replaced(grads: Gradients, **changes: torch.Tensor) -> Gradients:
    return Gradients(**{**dict(grads.items()), **changes})


@planted_backward("planted_bwd_dq_unscaled", "dq without the attention scale", "dq")
def dq_unscaled(inputs: KDAInputs, grads: Gradients) -> Gradients:
    scale = inputs.case.scale or inputs.case.head_k_dim**-0.5
    return replaced(grads, q=(grads.q.float() / scale).to(grads.q.dtype))


@planted_backward("planted_bwd_dk_chunk_edge", "dk of each chunk's last token left zero", "dk")
def dk_chunk_edge(inputs: KDAInputs, grads: Gradients) -> Gradients:
    dk = grads.k.clone()
    for row, start, end in inputs.case.row_spans:
        dk[row, start + CHUNK - 1 : end : CHUNK] = 0
    return replaced(grads, k=dk)


@planted_backward("planted_bwd_dv_tail", "dv of the last sequence's final partial chunk never written", "dv")
def dv_tail(inputs: KDAInputs, grads: Gradients) -> Gradients:
    row, start, end = inputs.case.row_spans[-1]
    dv = grads.v.clone()
    dv[row, start + (end - start) // CHUNK * CHUNK : end] = 0
    return replaced(grads, v=dv)


@planted_backward("planted_bwd_dg_no_reverse_cumsum", "dg of the cumulative decay, not of the gate", "dg")
def dg_no_reverse_cumsum(inputs: KDAInputs, grads: Gradients) -> Gradients:
    dg = grads.g.float()
    wrong = dg.clone()
    for row, start, end in inputs.case.row_spans:  # dG_t = dg_t - dg_{t+1} inside each chunk
        for c0 in range(start, end, CHUNK):
            c1 = min(end, c0 + CHUNK)
            wrong[row, c0 : c1 - 1] = dg[row, c0 : c1 - 1] - dg[row, c0 + 1 : c1]
    return replaced(grads, g=wrong.to(grads.g.dtype))


@planted_backward("planted_bwd_dbeta_no_sigmoid", "dbeta without the sigmoid's derivative", "dbeta")
def dbeta_no_sigmoid(inputs: KDAInputs, grads: Gradients) -> Gradients:
    if not inputs.case.beta_sigmoid_in_kernel:
        return grads
    s = torch.sigmoid(inputs.beta.float())
    return replaced(grads, beta=(grads.beta.float() / (s * (1 - s))).to(grads.beta.dtype))


@planted_backward("planted_bwd_dh0_unwritten", "dh0 never written", "dh0")
def dh0_unwritten(inputs: KDAInputs, grads: Gradients) -> Gradients:
    if grads.initial_state is None:
        return grads
    return replaced(grads, initial_state=torch.zeros_like(grads.initial_state))


@planted_backward("planted_bwd_dA_log_chain", "dA_log without exp(A_log) in the chain rule", "dA_log")
def dA_log_chain(inputs: KDAInputs, grads: Gradients) -> Gradients:
    if grads.A_log is None or inputs.A_log is None:
        return grads
    return replaced(grads, A_log=grads.A_log / torch.exp(inputs.A_log.float()))


@planted_backward("planted_bwd_ddt_bias_first_sequence", "ddt_bias summed over the first sequence only", "ddt_bias")
def ddt_bias_first_sequence(inputs: KDAInputs, grads: Gradients) -> Gradients:
    """``dt_bias`` is added to the raw gate of every token, so its gradient is the sum of ``dg`` over all of them;
    this one stops at the first sequence's end."""
    if grads.dt_bias is None:
        return grads
    row, start, end = inputs.case.row_spans[0]
    first = grads.g[row, start:end].float().sum(dim=0).reshape(-1)
    return replaced(grads, dt_bias=first.to(grads.dt_bias.dtype))


# Two more ways a backward goes wrong that are not one gradient's error: it varies from run to run (atomics
# that add in another order), or it reads scratch nobody wrote (a 128 MiB torch.empty buffer taken for zeros: on
# a CPU a block that large is mostly fresh zero pages from the system, under poisoned scratch NaN), and both.
class _VariesBackward(TorchChunk):
    name = "planted_bwd_varies"
    description = "dq changes in its last bits from run to run"

    def run_backward(self, inputs: KDAInputs, d_o: torch.Tensor, d_final: torch.Tensor | None) -> Gradients:
        return jittered_dq(super().run_backward(inputs, d_o, d_final))


def jittered_dq(grads: Gradients) -> Gradients:
    noise = 1 + 1e-6 * torch.randn(grads.q.shape, dtype=torch.float32, device=grads.q.device)
    return replaced(grads, q=(grads.q.float() * noise).to(grads.q.dtype))


class _ReadsScratch(TorchChunk):
    name = "planted_bwd_reads_scratch"
    description = "dv plus a torch.empty buffer it takes for zeros"

    def run_backward(self, inputs: KDAInputs, d_o: torch.Tensor, d_final: torch.Tensor | None) -> Gradients:
        grads = super().run_backward(inputs, d_o, d_final)
        scratch = torch.empty(1 << 25, dtype=torch.float32, device=grads.v.device)
        taken = scratch[: grads.v.numel()].view(grads.v.shape)
        return replaced(grads, v=(grads.v.float() + taken).to(grads.v.dtype))


class _VariesAndReadsScratch(_ReadsScratch):
    """A scratch reader whose plain runs differ, as one reading stale memory does: the check must not take it
    for a merely nondeterministic backward (it did, when two plain runs read different stale memory)."""

    name = "planted_bwd_varies_reads_scratch"
    description = "dv plus a torch.empty buffer, dq changing in its last bits from run to run"

    def run_backward(self, inputs: KDAInputs, d_o: torch.Tensor, d_final: torch.Tensor | None) -> Gradients:
        return jittered_dq(super().run_backward(inputs, d_o, d_final))


register(_VariesBackward.name, _VariesBackward)
register(_ReadsScratch.name, _ReadsScratch)
register(_VariesAndReadsScratch.name, _VariesAndReadsScratch)


class _GateCumsumInBf16(TorchChunk):
    """A precision bug a floor policy must keep catching: dg's reverse cumulative sum within each chunk carried in
    bf16 (an accumulator declared in the input dtype), where the baseline carries it in float32. Its error is
    every element's, of a few unit roundoffs: in bf16 cases about the size of one element one ulp off, which a
    looser floor would let through (the results journal, seventeenth session)."""

    name = "planted_bwd_dg_cumsum_bf16"
    description = "dg's reverse cumulative sum carried in bf16"

    def run_backward(self, inputs: KDAInputs, d_o: torch.Tensor, d_final: torch.Tensor | None) -> Gradients:
        case = inputs.case
        found = kda_gradients(
            inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, inputs.options, d_o, d_final,
            working_dtype=TORCH_DTYPES[case.dtype], chunk_size=self.chunk_size, tf32_dots=self.tf32_dots,
        )  # fmt: skip
        dg = found.g.float()
        carried = dg.clone()
        for row, start, end in case.row_spans:
            for c0 in range(start, end, CHUNK):
                c1 = min(end, c0 + CHUNK)
                step = dg[row, c0:c1].clone()  # the gradient of the cumulative decay, token by token
                step[:-1] -= dg[row, c0 + 1 : c1]
                total = torch.zeros_like(step[0], dtype=torch.bfloat16)
                for t in range(c1 - c0 - 1, -1, -1):
                    total = (total.float() + step[t]).bfloat16()
                    carried[row, c0 + t] = total.float()
        found = replaced(found, g=carried)
        return Gradients(**{n: x.to(stored_dtype(case, GRADIENT_TENSORS[n])) for n, x in found.items()})


register(_GateCumsumInBf16.name, _GateCumsumInBf16)
