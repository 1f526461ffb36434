"""The mask contract (window, softcap, ALiBi, seqlens_k, attn_mask) on the dense oracle and the tiled references:
values and gradients.

Every path is checked against ``formula`` (``mask_cases.py``), written from flash-attn's definitions with plain
torch ops over the whole score matrix (it shares no code with ``flashattn_teach.masks``), and the dense oracle
against torch's SDPA given the equivalent dense float mask where SDPA can express it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import flashattn_teach as fa
from flashattn_teach.reference import dense_attention, flash_backward, online_attention

from attention_strategies import Problem, problems
from mask_cases import ALL, NEG_INF, TILED, assert_lse_equal, formula


@st.composite
def masked_problems(draw, dtype=torch.float64, requires_grad=False):
    """A :class:`Problem` and a random mix of the mask options, including rows and tiles that see nothing."""
    p: Problem = draw(problems(dtype, requires_grad=requires_grad))
    B, H_q, N_q = p.q.shape[:3]
    N_k = p.k.shape[-2]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    opts: dict = {}
    if draw(st.booleans()):
        opts["window"] = (draw(st.integers(-1, 6)), draw(st.integers(-1, 6)))
    if draw(st.booleans()):
        opts["softcap"] = draw(st.floats(0.25, 4.0))
    slopes = draw(st.sampled_from([None, (H_q,), (B, H_q)]))
    if slopes is not None:
        opts["alibi_slopes"] = torch.rand(*slopes, generator=g, dtype=dtype)
    if draw(st.booleans()):
        opts["seqlens_k"] = torch.tensor(draw(st.lists(st.integers(0, N_k), min_size=B, max_size=B)))
    kind = draw(st.sampled_from([None, "bool", "float", "zero float"]))
    if kind is not None:
        shape = draw(st.sampled_from([(B, 1, N_q, N_k), (N_q, N_k), (1, H_q, 1, N_k), (B, H_q, N_q, N_k)]))
        seen = torch.rand(*shape, generator=g) < draw(st.sampled_from([0.2, 0.6, 1.0]))
        # A rectangle that sees nothing: whole tiles (and maybe rows) hidden.
        r0, c0 = draw(st.integers(0, shape[-2])), draw(st.integers(0, shape[-1]))
        seen[..., r0 : r0 + draw(st.integers(0, 9)), c0 : c0 + draw(st.integers(0, 9))] = False
        if kind == "bool":
            opts["attn_mask"] = seen
        else:
            bias = (
                torch.zeros(shape, dtype=dtype)
                if kind == "zero float"
                else torch.randn(shape, generator=g, dtype=dtype)
            )
            opts["attn_mask"] = bias.masked_fill(~seen, NEG_INF)
    return p, opts


def loss(O, lse):
    """A loss through ``O`` and the finite ``lse``: rows that see no key carry no lse gradient."""
    w = torch.linspace(-1, 1, O.shape[-1], dtype=O.dtype)
    return (O * w).sum() + torch.where(torch.isneginf(lse), 0.0, lse).sum()


# ------------------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("attention", ALL)
@settings(max_examples=30)
@given(case=masked_problems(torch.float64, requires_grad=True))
def test_matches_the_formula_for_any_mask_float64(attention, case):
    """Window, causal in both alignments, softcap, ALiBi, seqlens_k and attn_mask, alone and together:
    values and the gradients of q, k, v, tiles of any size."""
    p, opts = case
    tiles = {} if attention is dense_attention else p.tiles
    O, lse = attention(p.q, p.k, p.v, return_lse=True, **p.kwargs, **opts, **tiles)
    O_ref, lse_ref = formula(p.q, p.k, p.v, **p.kwargs, **opts)
    torch.testing.assert_close(O, O_ref, atol=1e-12, rtol=0)
    assert_lse_equal(lse, lse_ref, 1e-12)
    grads = torch.autograd.grad(loss(O, lse), (p.q, p.k, p.v))
    refs = torch.autograd.grad(loss(O_ref, lse_ref), (p.q, p.k, p.v))
    for name, got, ref in zip("qkv", grads, refs, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=0, msg=f"d{name}")


@pytest.mark.parametrize("attention", TILED)
@settings(max_examples=25)
@given(case=masked_problems(torch.float32, requires_grad=True))
def test_matches_the_float64_formula_for_any_mask_float32(attention, case):
    p, opts = case
    O, lse = attention(p.q, p.k, p.v, return_lse=True, **p.kwargs, **opts, **p.tiles)
    assert O.dtype == torch.float32
    q, k, v = (t.detach().double().requires_grad_() for t in (p.q, p.k, p.v))
    wide = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in opts.items()}
    O_ref, lse_ref = formula(q, k, v, **p.kwargs, **wide)
    torch.testing.assert_close(O.double(), O_ref, atol=2e-5, rtol=0)
    assert_lse_equal(lse, lse_ref, 2e-5)
    grads = torch.autograd.grad(loss(O, lse), (p.q, p.k, p.v))
    refs = torch.autograd.grad(loss(O_ref, lse_ref), (q, k, v))
    for name, got, ref in zip("qkv", grads, refs, strict=True):
        torch.testing.assert_close(got.double(), ref, atol=2e-4, rtol=0, msg=f"d{name}")


@settings(max_examples=20)
@given(case=masked_problems(torch.float64))
def test_flash_backward_matches_the_formula_for_any_mask(case):
    p, opts = case
    O, lse = online_attention(p.q, p.k, p.v, return_lse=True, **p.kwargs, **opts, **p.tiles)
    dO = torch.randn_like(O)
    grads = flash_backward(p.q, p.k, p.v, O, lse, dO, **p.kwargs, **opts, **p.tiles)
    q, k, v = (t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v))
    refs = torch.autograd.grad(formula(q, k, v, **p.kwargs, **opts)[0], (q, k, v), dO)
    for name, got, ref in zip("qkv", grads, refs, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=0, msg=f"d{name}")


@settings(max_examples=20)
@given(case=masked_problems(torch.float64))
def test_dense_matches_torch_sdpa_given_the_equivalent_float_mask(case):
    """Window, causal, seqlens_k and ALiBi written as one additive mask for torch (softcap has no SDPA form)."""
    p, opts = case
    opts.pop("softcap", None)
    B, H_q, N_q = p.q.shape[:3]
    N_k = p.k.shape[-2]
    with torch.no_grad():
        i, j = torch.arange(N_q)[:, None], torch.arange(N_k)[None, :]
        bias = torch.zeros(B, H_q, N_q, N_k, dtype=torch.float64)
        seen = formula_visible(p, opts, i, j)
        if "alibi_slopes" in opts:
            off = diagonal(p, opts)
            bias = bias - opts["alibi_slopes"].reshape(-1, H_q, 1, 1) * (i + off - j).abs()
        m = opts.get("attn_mask")
        if m is not None and m.dtype != torch.bool:
            bias = bias + m
        bias = bias.masked_fill(~seen, NEG_INF)
    kv_heads = H_q // p.k.shape[1]
    expected = F.scaled_dot_product_attention(
        p.q, p.k.repeat_interleave(kv_heads, 1), p.v.repeat_interleave(kv_heads, 1), attn_mask=bias
    )
    got = dense_attention(p.q, p.k, p.v, **p.kwargs, **opts)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def diagonal(p, opts):
    """:func:`formula`'s diagonal offset: 0, ``N_k - N_q``, or ``seqlens_k[b] - N_q`` per batch element."""
    N_q, N_k = p.q.shape[-2], p.k.shape[-2]
    if p.causal_align == "top_left":
        return 0
    if "seqlens_k" in opts:
        return (opts["seqlens_k"] - N_q).reshape(-1, 1, 1, 1)
    return N_k - N_q


def formula_visible(p, opts, i, j):
    """The bool visibility of :func:`formula`, for the SDPA comparison."""
    B, H_q, N_q = p.q.shape[:3]
    N_k = p.k.shape[-2]
    off = diagonal(p, opts)
    seen = torch.ones(B, H_q, N_q, N_k, dtype=torch.bool)
    if p.causal:
        seen &= j <= i + off
    left, right = opts.get("window", (-1, -1))
    if left >= 0:
        seen &= j >= i + off - left
    if right >= 0:
        seen &= j <= i + off + right
    if "seqlens_k" in opts:
        seen &= j < opts["seqlens_k"][:, None, None, None]
    m = opts.get("attn_mask")
    if m is not None:
        seen &= m if m.dtype == torch.bool else ~torch.isneginf(m)
    return seen


@pytest.mark.parametrize("causal_align", ["top_left", "bottom_right"])
def test_causal_is_the_window_with_right_side_zero(causal_align):
    q, k, v = (torch.randn(2, 3, n, 4, dtype=torch.float64) for n in (7, 11, 11))
    a = online_attention(q, k, v, causal=True, causal_align=causal_align, block_m=3, block_n=4)
    b = online_attention(q, k, v, window=(-1, 0), causal_align=causal_align, block_m=3, block_n=4)
    c = online_attention(q, k, v, causal=True, window=(-1, 5), causal_align=causal_align, block_m=3, block_n=4)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(a, c, atol=0, rtol=0)


def test_a_window_without_causal_is_not_mistaken_for_plain_attention():
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    assert "window read tile by tile" in fa.explain(q, k, v, window=(-1, 0)).reason
    assert "window" not in fa.explain(q, k, v, window=(-1, 0), is_causal=True).reason  # this one is just causal
    for backend in ("parallel", "query_major", "key_major", "dense"):
        got = fa.flash_attention(q, k, v, window=(-1, 0), backend=backend)
        torch.testing.assert_close(got, formula(q, k, v, causal=True)[0], msg=backend)


def test_jvp_through_a_window_softcap_and_alibi_matches_the_dense_oracle():
    g = torch.Generator().manual_seed(3)
    q, k, v, tq, tk, tv = (torch.randn(1, 2, 9, 4, dtype=torch.float64, generator=g) for _ in range(6))
    kw = dict(window=(2, 1), softcap=1.5, alibi_slopes=torch.tensor([0.3, 0.7], dtype=torch.float64))
    _, t_tiled = torch.func.jvp(lambda *a: online_attention(*a, **kw, block_m=2, block_n=3), (q, k, v), (tq, tk, tv))
    _, t_dense = torch.func.jvp(lambda *a: dense_attention(*a, **kw), (q, k, v), (tq, tk, tv))
    torch.testing.assert_close(t_tiled, t_dense, atol=1e-12, rtol=0)
