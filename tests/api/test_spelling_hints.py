"""Natural mistakes get a hint: the other API's spelling of ``causal``, and a transformers-style padding mask
``(B, N_k)`` of 0/1 passed as ``attn_mask`` where it cannot be what torch's rules read (a 2-D mask is
``(N_q, N_k)``). The hint only comes with an error the call raised anyway; a call that is legal is left as
torch leaves it."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import flashattn_teach as fa


def _qkv(B=2, H=2, N_q=3, N_k=5, D=8):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(B, H, N_q, D, generator=g),
        torch.randn(B, H, N_k, D, generator=g),
        torch.randn(B, H, N_k, D, generator=g),
    )


def test_is_causal_given_to_flash_attention_names_causal():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'is_causal': flash_attention spells it causal="):
        fa.flash_attention(q, k, v, is_causal=True)
    # the spelling it names is the one that works, and gives torch's causal attention
    torch.testing.assert_close(
        fa.flash_attention(q, k, v, causal=True), F.scaled_dot_product_attention(q, k, v, is_causal=True)
    )


def test_the_hint_comes_before_any_other_refusal_and_costs_flash_attention_no_layer():
    q, k, v = _qkv()
    # another unknown keyword first, or with causal= as well: the hint still names the spelling, as it did
    # when it was its own wrapper around the call
    for keywords in ({"bogus": 1, "is_causal": True}, {"is_causal": True, "causal": True}):
        with pytest.raises(TypeError, match=r"'is_causal': flash_attention spells it causal="):
            fa.flash_attention(q, k, v, **keywords)
    # one wrapper between the caller and the body: the hint is asked only on the refusal path
    assert not hasattr(fa.flash_attention.__wrapped__, "__wrapped__")


def test_causal_given_to_scaled_dot_product_attention_names_is_causal():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"'causal': scaled_dot_product_attention spells it is_causal="):
        fa.scaled_dot_product_attention(q, k, v, causal=True)


def test_other_unexpected_keywords_keep_pythons_error():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="unexpected keyword argument 'casual'"):
        fa.flash_attention(q, k, v, casual=True)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.bool])
def test_a_padding_mask_that_cannot_broadcast_says_how_to_pass_it(dtype):
    q, k, v = _qkv(B=2, N_q=3, N_k=5)  # (B, N_k) = (2, 5) does not broadcast as (N_q, N_k) = (3, 5)
    padding = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]).to(dtype)
    fix = "mask" if dtype == torch.bool else "mask.bool()"
    with pytest.raises(RuntimeError, match=rf"padding mask \(B, N_k\).*attn_mask={re.escape(fix)}\[:, None, None, :\]"):
        fa.scaled_dot_product_attention(q, k, v, attn_mask=padding)
    # the fix it gives is right: torch's SDPA with that boolean mask
    fixed = padding.bool()[:, None, None, :]
    torch.testing.assert_close(
        fa.scaled_dot_product_attention(q, k, v, attn_mask=fixed),
        F.scaled_dot_product_attention(q, k, v, attn_mask=fixed),
    )


def test_an_integer_padding_mask_is_refused_with_the_hint_even_where_its_shape_broadcasts():
    q, k, v = _qkv(B=2, N_q=2, N_k=5)  # (2, 5) broadcasts as (N_q, N_k), but torch refuses integer masks
    padding = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v, attn_mask=padding)
    with pytest.raises(TypeError, match=r"attn_mask=mask.bool\(\)\[:, None, None, :\]"):
        fa.scaled_dot_product_attention(q, k, v, attn_mask=padding)


def test_a_float_mask_of_that_shape_that_broadcasts_stays_legal_and_unhinted():
    q, k, v = _qkv(B=2, N_q=2, N_k=5)  # (2, 5) is a legal additive (N_q, N_k) mask in torch's rules
    additive = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0, 1.0]])
    torch.testing.assert_close(
        fa.scaled_dot_product_attention(q, k, v, attn_mask=additive),
        F.scaled_dot_product_attention(q, k, v, attn_mask=additive),
    )


def test_a_mask_of_another_shape_gets_no_padding_hint():
    q, k, v = _qkv(B=2, N_q=3, N_k=5)
    with pytest.raises(RuntimeError) as refused:
        fa.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(4, 5, dtype=torch.bool))
    assert "does not broadcast" in str(refused.value)
    assert "padding mask" not in str(refused.value)
