"""core/backward.py: the tiled backward against torch autograd through the dense oracle and through SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from flashattn_teach.core import dense_attention, flash_backward, tile_terms

F64 = torch.float64


def leaves(N_q: int, N_k: int, seed: int, gain: float = 1.0, D: int = 16, D_v: int = 8):
    g = torch.Generator().manual_seed(seed)
    shapes = ((2, 2, N_q, D), (2, 2, N_k, D), (2, 2, N_k, D_v))
    q, k, v = (
        (torch.randn(s, generator=g, dtype=F64) * w).requires_grad_()
        for s, w in zip(shapes, (gain, gain, 1), strict=True)
    )
    return q, k, v, torch.randn(2, 2, N_q, D_v, generator=g, dtype=F64)


@given(
    N_q=st.integers(1, 80),
    N_k=st.integers(1, 80),
    block_m=st.integers(1, 40),
    block_n=st.integers(1, 40),
    causal=st.booleans(),
)
def test_flash_backward_matches_autograd_for_any_tiling(N_q, N_k, block_m, block_n, causal) -> None:
    q, k, v, dO = leaves(N_q, N_k, seed=N_q * 100 + N_k)
    O, lse = dense_attention(q, k, v, causal=causal)
    grads = torch.autograd.grad(O, (q, k, v), dO)
    with torch.no_grad():
        mine = flash_backward(q, k, v, O, dO, lse, causal=causal, block_m=block_m, block_n=block_n)
    for name, a, b in zip("qkv", mine, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"d{name}")
    sdpa = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), dO)
    for name, a, b in zip("qkv", mine, sdpa, strict=True):
        torch.testing.assert_close(a, b, msg=f"d{name} vs SDPA")


@pytest.mark.parametrize("causal", [False, True])
def test_flash_backward_with_logits_near_1e3_has_no_nan(causal: bool) -> None:
    q, k, v, dO = leaves(40, 60, seed=1, gain=20.0)
    O, lse = dense_attention(q, k, v, causal=causal)
    assert (lse - O.new_tensor(0)).abs().max() > 500  # logits this large are the case
    grads = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), dO)
    mine = flash_backward(q.detach(), k.detach(), v.detach(), O.detach(), dO, lse.detach(), causal, block_m=16)
    for a, b in zip(mine, grads, strict=True):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b)


def test_tile_terms_hooks_give_the_chain_rule_of_softcap_and_dropout() -> None:
    """A one-tile softcapped, dropped attention: tile_terms with the ``scores`` and ``drop`` hooks equals
    autograd through the same formula written densely."""
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 1, 6, 4, generator=g, dtype=F64).requires_grad_() for _ in range(2))
    v = torch.randn(1, 1, 6, 5, generator=g, dtype=F64).requires_grad_()
    dO = torch.randn(1, 1, 6, 5, generator=g, dtype=F64)
    keep = torch.rand(6, 6, generator=g) > 0.3
    cap, scale = 2.0, 0.7
    S = cap * torch.tanh(scale * q @ k.transpose(-2, -1) / cap)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    P = torch.softmax(S.masked_fill(~mask, float("-inf")), dim=-1)
    O = (P * keep / 0.7) @ v
    grads = torch.autograd.grad(O, (q, k, v), dO)
    lse = torch.logsumexp(S.masked_fill(~mask, float("-inf")), dim=-1).detach()
    delta = (dO * O.detach()).sum(-1)

    def softcap(S):
        T = torch.tanh(S / cap)
        return cap * T, lambda dS: dS * (1 - T * T)

    t = tile_terms(
        q.detach(), k.detach(), v.detach(), dO, lse, delta, scale, mask, scores=softcap, drop=lambda x: x * keep / 0.7
    )
    for a, b in zip((t.dQ, t.dK, t.dV), grads, strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(t.P, P.detach())
