"""The float64 reference against hand-written formulas and its own invariances."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kda_cases.materialize import KDAOptions
from kda_reference.preprocess import gate_activation, l2norm
from kda_reference.recurrent import kda_recurrent

f64 = torch.float64


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=f64)


def inputs(T: int = 5, H: int = 2, HV: int = 2, K: int = 4, V: int = 3, B: int = 1, seed: int = 0):
    q, k = rand(B, T, H, K, seed=seed), F.normalize(rand(B, T, H, K, seed=seed + 1), dim=-1)
    v = rand(B, T, HV, V, seed=seed + 2)
    g = F.logsigmoid(rand(B, T, HV, K, seed=seed + 3))
    beta = torch.sigmoid(rand(B, T, HV, seed=seed + 4))
    return q, k, v, g, beta


def test_one_token_from_zero_state_is_beta_k_v() -> None:
    q, k, v, g, beta = inputs(T=1, H=1, HV=1)
    res = kda_recurrent(q, k, v, g, beta, KDAOptions(scale=1.0))
    # S = beta k v^T, o = q^T S = beta (q.k) v
    want = beta[0, 0, 0] * (q[0, 0, 0] @ k[0, 0, 0]) * v[0, 0, 0]
    torch.testing.assert_close(res.o[0, 0, 0], want, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(res.final_state[0, 0], beta[0, 0, 0] * torch.outer(k[0, 0, 0], v[0, 0, 0]))


def test_three_tokens_by_hand_with_initial_state_and_scale() -> None:
    q, k, v, g, beta = inputs(T=3, H=1, HV=1)
    h0 = rand(1, 1, 4, 3, seed=9)
    scale = 0.37
    res = kda_recurrent(q, k, v, g, beta, KDAOptions(scale=scale, initial_state=h0))
    S = h0[0, 0].clone()
    for t in range(3):
        kt, vt, bt = k[0, t, 0], v[0, t, 0], beta[0, t, 0]
        S = torch.diag(torch.exp(g[0, t, 0])) @ S
        S = S + bt * torch.outer(kt, vt - S.T @ kt)
        torch.testing.assert_close(res.o[0, t, 0], scale * S.T @ q[0, t, 0], rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(res.final_state[0, 0], S, rtol=1e-13, atol=1e-13)


def test_two_tokens_closed_form() -> None:
    # With g = 0 and orthonormal keys, the delta rule writes each value into its own key slot.
    k = torch.zeros(1, 2, 1, 2, dtype=f64)
    k[0, 0, 0, 0] = 1.0
    k[0, 1, 0, 1] = 1.0
    v = torch.tensor([[[[2.0]], [[3.0]]]], dtype=f64)
    q = torch.ones(1, 2, 1, 2, dtype=f64)
    g = torch.zeros(1, 2, 1, 2, dtype=f64)
    beta = torch.ones(1, 2, 1, dtype=f64)
    res = kda_recurrent(q, k, v, g, beta, KDAOptions(scale=1.0))
    assert res.o[0, :, 0, 0].tolist() == [2.0, 5.0]
    assert res.final_state[0, 0, :, 0].tolist() == [2.0, 3.0]


def test_k_first_equals_v_first() -> None:
    q, k, v, g, beta = inputs(T=7)
    h0 = rand(1, 2, 4, 3, seed=5)
    a = kda_recurrent(q, k, v, g, beta, KDAOptions(initial_state=h0, checkpoints=[(0, 3)]))
    b = kda_recurrent(
        q, k, v, g, beta, KDAOptions(initial_state=h0.transpose(-1, -2), state_v_first=True, checkpoints=[(0, 3)])
    )
    torch.testing.assert_close(a.o, b.o, rtol=0, atol=0)
    torch.testing.assert_close(a.final_state, b.final_state.transpose(-1, -2), rtol=0, atol=0)
    torch.testing.assert_close(a.checkpoint_states, b.checkpoint_states.transpose(-1, -2), rtol=0, atol=0)


def test_gva_equals_repeated_heads() -> None:
    q, k, v, g, beta = inputs(T=6, H=2, HV=4)
    gva = kda_recurrent(q, k, v, g, beta)
    rep = kda_recurrent(q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2), v, g, beta)
    torch.testing.assert_close(gva.o, rep.o, rtol=0, atol=0)
    torch.testing.assert_close(gva.final_state, rep.final_state, rtol=0, atol=0)


def test_packed_batch_equals_each_sequence_alone_with_zero_length_member() -> None:
    lens = [5, 0, 3, 7]
    q, k, v, g, beta = inputs(T=sum(lens))
    h0 = rand(len(lens), 2, 4, 3, seed=8)
    cu = torch.tensor([0, 5, 5, 8, 15])
    packed = kda_recurrent(q, k, v, g, beta, KDAOptions(initial_state=h0, cu_seqlens=cu))
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        piece = (x[:, s:e] for x in (q, k, v, g, beta))
        alone = kda_recurrent(*piece, KDAOptions(initial_state=h0[n : n + 1]))
        torch.testing.assert_close(packed.o[:, s:e], alone.o, rtol=0, atol=0)
        torch.testing.assert_close(packed.final_state[n], alone.final_state[0], rtol=0, atol=0)
    # A zero-length sequence's final state is its initial state.
    torch.testing.assert_close(packed.final_state[1], h0[1], rtol=0, atol=0)


def test_batch_rows_equal_packed_sequences() -> None:
    q, k, v, g, beta = inputs(T=6, B=3)
    batched = kda_recurrent(q, k, v, g, beta)
    flat = [x.reshape(1, 18, *x.shape[2:]) for x in (q, k, v, g, beta)]
    packed = kda_recurrent(*flat, KDAOptions(cu_seqlens=[0, 6, 12, 18]))
    torch.testing.assert_close(batched.o.reshape(1, 18, 2, 3), packed.o, rtol=0, atol=0)
    torch.testing.assert_close(batched.final_state, packed.final_state, rtol=0, atol=0)


@pytest.mark.parametrize("split", [1, 17, 40])
def test_prefix_then_resumed_suffix_equals_whole_run(split: int) -> None:
    q, k, v, g, beta = inputs(T=41, K=8, V=8, seed=3)
    h0 = rand(1, 2, 8, 8, seed=4)
    whole = kda_recurrent(q, k, v, g, beta, KDAOptions(initial_state=h0, checkpoints=[(0, split)]))
    pre = kda_recurrent(*(x[:, :split] for x in (q, k, v, g, beta)), KDAOptions(initial_state=h0))
    post = kda_recurrent(*(x[:, split:] for x in (q, k, v, g, beta)), KDAOptions(initial_state=pre.final_state))
    torch.testing.assert_close(torch.cat([pre.o, post.o], 1), whole.o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(post.final_state, whole.final_state, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(whole.checkpoint_states[0], pre.final_state[0], rtol=0, atol=0)


def test_checkpoint_zero_is_initial_state_and_end_is_final() -> None:
    q, k, v, g, beta = inputs(T=4)
    h0 = rand(1, 2, 4, 3, seed=2)
    res = kda_recurrent(q, k, v, g, beta, KDAOptions(initial_state=h0, checkpoints=[(0, 0), (0, 4)]))
    torch.testing.assert_close(res.checkpoint_states[0], h0[0], rtol=0, atol=0)
    torch.testing.assert_close(res.checkpoint_states[1], res.final_state[0], rtol=0, atol=0)


def test_in_kernel_preprocessing_equals_preprocessed_inputs() -> None:
    q, k, v, g_raw, beta_raw = inputs(T=9)
    HV, K = 2, 4
    A_log, dt_bias = rand(HV, seed=11), rand(HV * K, seed=12)
    options = KDAOptions(
        use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        use_gate_in_kernel=True,
        A_log=A_log,
        dt_bias=dt_bias,
    )
    fused = kda_recurrent(q, k, v, g_raw, beta_raw, options)
    g = -torch.exp(A_log)[:, None] * F.softplus(g_raw + dt_bias.view(HV, K))
    plain = kda_recurrent(l2norm(q), l2norm(k), v, g, torch.sigmoid(beta_raw))
    torch.testing.assert_close(fused.o, plain.o, rtol=1e-14, atol=1e-14)


def test_gate_forms_by_hand() -> None:
    x = torch.tensor([[[-30.0, 0.0, 25.0]]], dtype=f64)  # [T=1, HV=1, K=3]
    A_log = torch.tensor([math.log(2.0)], dtype=f64)
    bias = torch.tensor([1.0, 0.0, -1.0], dtype=f64)
    soft = gate_activation(x, in_kernel=True, A_log=A_log, dt_bias=bias)
    assert soft[0, 0, 2].item() == -2.0 * 24.0  # softplus(x) = x above the threshold 20
    torch.testing.assert_close(soft[0, 0, 1], torch.tensor(-2.0 * math.log(2.0), dtype=f64))
    lb = gate_activation(x, in_kernel=True, A_log=A_log, dt_bias=bias, lower_bound=-5.0)
    torch.testing.assert_close(lb[0, 0, 1], torch.tensor(-2.5, dtype=f64))
    assert -5.0 <= lb.min() and lb.max() < 0
    no_a = gate_activation(x, in_kernel=True, dt_bias=bias, lower_bound=-1.0)
    torch.testing.assert_close(no_a, -torch.sigmoid(x + bias))
    assert gate_activation(x, in_kernel=False) is x


def test_l2norm_has_fla_epsilon() -> None:
    x = torch.tensor([[3.0, 4.0]], dtype=f64)
    torch.testing.assert_close(l2norm(x), x / math.sqrt(25.0 + 1e-6))


def test_low_precision_inputs_are_upcast_not_computed_low() -> None:
    q, k, v, g, beta = inputs(T=8)
    lo = [x.to(torch.bfloat16) for x in (q, k, v, g, beta)]
    res = kda_recurrent(*lo)
    want = kda_recurrent(*(x.to(f64) for x in lo))
    assert res.o.dtype == f64
    torch.testing.assert_close(res.o, want.o, rtol=0, atol=0)


def test_agrees_with_fla_naive_recurrent_to_fp32_precision() -> None:
    from fla.ops.kda.naive import naive_recurrent_kda

    q, k, v, g, beta = inputs(T=50, H=2, HV=4, K=16, V=8, seed=7)
    h0 = rand(1, 4, 16, 8, seed=1)
    ours = kda_recurrent(q, k, v, g, beta, KDAOptions(initial_state=h0))
    o, S = naive_recurrent_kda(
        *(x.float() for x in (q, k, v, g, beta)), initial_state=h0.float(), output_final_state=True
    )
    torch.testing.assert_close(o.double(), ours.o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S.double(), ours.final_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(cu_seqlens=[0, 3, 2]), "non-decreasing"),
        (dict(cu_seqlens=[0, 99]), "ends at 99"),
        (dict(initial_state=torch.zeros(2, 2, 4, 3, dtype=f64)), "initial_state must have shape"),
        (dict(checkpoints=[(0, 6)]), "5-token sequence"),
        (dict(checkpoints=[(1, 0)]), "names sequence 1"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kda_recurrent(*inputs(T=5), KDAOptions(**kwargs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.cuda
def test_runs_on_cuda_like_cpu() -> None:
    args = inputs(T=20)
    cpu = kda_recurrent(*args)
    gpu = kda_recurrent(*(x.cuda() for x in args))
    torch.testing.assert_close(gpu.o.cpu(), cpu.o, rtol=1e-12, atol=1e-12)
