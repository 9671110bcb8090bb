"""A small KDA library for the suite's own tests of standalone repros: ``chunk_kda`` with FLA's signature, a
float32 token loop, and one planted bug of real kernels (FLA's ``prepare_chunk_indices`` before PR #909): a
zero-length member of ``cu_seqlens`` shifts the initial states of the sequences after it by one; and one of
a backward pass: the gradient of ``beta`` at each sequence's last token is dropped (a tile's tail masked out
in a backward kernel). Both unless ``FAKE_KDA_FIXED=1`` (the release that fixed them). It imports torch alone,
as a kernel library a maintainer installs would."""

import os

import torch
import torch.nn.functional as F


def _gate(g, use_gate_in_kernel, A_log, dt_bias, lower_bound):
    if not use_gate_in_kernel:
        return g
    HV, K = g.shape[-2:]
    x = g + dt_bias.reshape(HV, K) if dt_bias is not None else g
    if lower_bound is None:
        return -torch.exp(A_log).reshape(HV, 1) * F.softplus(x, threshold=20.0)
    if A_log is not None:
        x = torch.exp(A_log).reshape(HV, 1) * x
    return lower_bound * torch.sigmoid(x)


class _LastTokenGradientDropped(torch.autograd.Function):
    """The identity, whose backward zeroes the gradient at each sequence's last token."""

    @staticmethod
    def forward(ctx, x, bounds):
        ctx.bounds = bounds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        for row, start, end in ctx.bounds:
            if end > start:
                grad[row, end - 1] = 0
        return grad, None


def chunk_kda(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True, cu_seqlens=None,
    use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, use_gate_in_kernel=False, A_log=None,
    dt_bias=None, lower_bound=None, state_v_first=False, **unused,
):  # fmt: skip
    dtype = q.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if use_qk_l2norm_in_kernel:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (K**-0.5 if scale is None else scale)
    fixed = os.environ.get("FAKE_KDA_FIXED") == "1"
    if cu_seqlens is None:
        bounds = [(row, 0, T) for row in range(B)]
    else:
        offsets = [int(x) for x in cu_seqlens]
        bounds = [(0, offsets[n], offsets[n + 1]) for n in range(len(offsets) - 1)]
    if not fixed:
        beta = _LastTokenGradientDropped.apply(beta, bounds)
    beta = torch.sigmoid(beta) if use_beta_sigmoid_in_kernel else beta
    g = _gate(g, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    h0 = torch.zeros(len(bounds), HV, K, V, device=q.device)
    if initial_state is not None:
        h0 = initial_state.float().transpose(-1, -2) if state_v_first else initial_state.float()
    o = torch.zeros(B, T, HV, V, device=q.device)
    final = torch.zeros_like(h0)
    empty_before = 0
    for n, (row, start, end) in enumerate(bounds):
        S = h0[n - empty_before].clone()  # the planted bug: an empty member shifts the states after it
        empty_before += start == end and not fixed
        for t in range(start, end):
            S = S * torch.exp(g[row, t]).unsqueeze(-1)
            residual = v[row, t] - torch.einsum("hk,hkv->hv", k[row, t], S)
            S = S + torch.einsum("hk,hv->hkv", beta[row, t].unsqueeze(-1) * k[row, t], residual)
            o[row, t] = torch.einsum("hk,hkv->hv", q[row, t], S)
        final[n] = S
    return o.to(dtype), final.transpose(-1, -2) if state_v_first else final
