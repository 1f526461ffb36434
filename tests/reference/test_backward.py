"""The memory-efficient backward against autograd through the dense oracle, and what it saves."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from flashattn_teach.reference import dense_attention, flash_backward, key_major_attention, online_attention

from attention_strategies import problems

TILED = [pytest.param(online_attention, id="query_major"), pytest.param(key_major_attention, id="key_major")]


def _finite_lse_loss(O, lse, dO, dlse):
    # lse = -inf on rows that see no key; such rows carry no lse gradient.
    return (O * dO).sum() + (torch.where(torch.isneginf(lse), 0.0, lse) * dlse).sum()


@pytest.mark.parametrize("attention", TILED)
@pytest.mark.parametrize(
    "shape, causal, causal_align",
    [
        ((1, 2, 5, 3, 4, 2, 2), False, "top_left"),  # (B, H_q, N_q, N_k, D, D_v, H_kv)
        ((2, 2, 4, 4, 3, 3, 1), True, "top_left"),
        ((1, 4, 3, 6, 2, 3, 2), True, "bottom_right"),
        ((1, 1, 6, 3, 2, 2, 1), True, "bottom_right"),  # rows 0-2 see no key
    ],
)
def test_gradcheck_float64(attention, shape, causal, causal_align):
    B, H_q, N_q, N_k, D, D_v, H_kv = shape
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H_q, N_q, D, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(B, H_kv, N_k, D, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(B, H_kv, N_k, D_v, dtype=torch.float64, generator=g, requires_grad=True)

    def f(q, k, v):
        O, lse = attention(
            q, k, v, causal=causal, causal_align=causal_align, enable_gqa=True, block_m=2, block_n=2, return_lse=True
        )
        return O, torch.where(torch.isneginf(lse), 0.0, lse)  # gradcheck needs finite outputs

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("attention", TILED)
@settings(max_examples=25)
@given(p=problems(torch.float32, requires_grad=True))
def test_gradients_match_dense_autograd_float32(attention, p):
    O, lse = attention(p.q, p.k, p.v, return_lse=True, **p.kwargs, **p.tiles)
    dO, dlse = torch.randn_like(O), torch.randn_like(lse)
    grads = torch.autograd.grad(_finite_lse_loss(O, lse, dO, dlse), (p.q, p.k, p.v))

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (p.q, p.k, p.v))
    O_ref, lse_ref = dense_attention(q64, k64, v64, return_lse=True, **p.kwargs)
    refs = torch.autograd.grad(_finite_lse_loss(O_ref, lse_ref, dO.double(), dlse.double()), (q64, k64, v64))
    for name, g, r in zip("qkv", grads, refs, strict=True):
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4, msg=f"d{name}")


@settings(max_examples=25)
@given(p=problems(torch.float64, requires_grad=True))
def test_flash_backward_matches_dense_autograd_float64(p):
    O_ref, lse_ref = dense_attention(p.q, p.k, p.v, return_lse=True, **p.kwargs)
    dO = torch.randn_like(O_ref)
    refs = torch.autograd.grad((O_ref * dO).sum(), (p.q, p.k, p.v))
    with torch.no_grad():
        grads = flash_backward(p.q, p.k, p.v, O_ref, lse_ref, dO, **p.kwargs, **p.tiles)
    for name, g, r in zip("qkv", grads, refs, strict=True):
        assert g.shape == r.shape, name
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-10, msg=f"d{name}")


@pytest.mark.parametrize("attention", TILED)
def test_autograd_saves_only_q_k_v_o_lse(attention):
    """Nothing of size N_q x N_k may be kept for backward: only q, k, v, O and lse."""
    N, D = 64, 2  # one head's N x N scores (4096) dwarf every O(N) tensor (<= 128 elements)
    q, k, v = (torch.randn(1, 1, N, D, requires_grad=True) for _ in range(3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        O = attention(q, k, v, block_m=8, block_n=8)
    assert len(saved) == 5
    assert max(t.numel() for t in saved) <= N * D
    assert {tuple(t.shape) for t in saved} == {(1, 1, N, D), (1, 1, N)}

    # The dense oracle, differentiated by plain autograd, does keep N x N tensors: the check can fail.
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        dense_attention(q, k, v)
    assert max(t.numel() for t in saved) >= N * N
    O.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_broadcast_batch_gradients_sum_over_the_broadcast():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 2, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 6, 4, dtype=torch.float64, generator=g, requires_grad=True)  # broadcast over batch
    v = torch.randn(2, 6, 3, dtype=torch.float64, generator=g, requires_grad=True)  # rank 3: (H, N_k, D_v)
    assert torch.autograd.gradcheck(lambda q, k, v: online_attention(q, k, v, block_m=2, block_n=4), (q, k, v))
