"""The mask options through the public API: a Hugging Face padding mask, a mask that requires grad, bad
options named, and batch shapes other than ``(B,)`` mapping each option to its element."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import flashattn_teach as fa
from flashattn_teach.reference import dense_attention, online_attention

from attention_strategies import parallel_attention
from mask_cases import ALL, NEG_INF, assert_lse_equal, count_score_tiles, formula

# --------------------------------------------------------------------------------------------------- API


@pytest.mark.parametrize("kind", ["bool", "float min", "float -inf"])
def test_a_left_padded_batch_with_a_hugging_face_mask_runs_tiled_and_matches_torch(kind):
    """The 4-D mask a Hugging Face decoder builds for left padding: (B, 1, N_q, N_k), causal and padding."""
    B, H, N, D = 3, 4, 37, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    pad = torch.tensor([0, 5, 20])  # left padding per sequence
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    seen = (j <= i) & (j >= pad[:, None, None, None])  # (B, 1, N, N)
    if kind == "bool":
        mask = seen
    else:
        hidden = torch.finfo(q.dtype).min if kind == "float min" else NEG_INF
        mask = torch.zeros(B, 1, N, N).masked_fill(~seen, hidden)
    plan = fa.explain(q, k, v, attn_mask=mask)
    assert plan.backend != "dense" and "skipped" in plan.reason
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    theirs = [t.clone().requires_grad_() for t in (q, k, v)]
    got = fa.scaled_dot_product_attention(*ours, attn_mask=mask)
    expected = F.scaled_dot_product_attention(*theirs, attn_mask=mask)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=0)
    dO = torch.randn(got.shape, generator=g)
    for name, a, b in zip(
        "qkv", torch.autograd.grad(got, ours, dO), torch.autograd.grad(expected, theirs, dO), strict=True
    ):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0, msg=f"d{name}")


def test_triton_takes_the_variants_and_refuses_a_mask_that_requires_grad():
    q = torch.randn(1, 1, 5, 16)
    assert fa.explain(q, q, q, window=(2, 0), softcap=3.0, backend="triton").backend == "triton"
    assert fa.explain(q, q, q, seqlens_k=torch.tensor([3]), backend="triton").backend == "triton"
    with pytest.raises(NotImplementedError, match="attn_mask requires grad"):
        fa.explain(q, q, q, attn_mask=torch.zeros(5, 5, requires_grad=True), backend="triton")
    p = fa.explain(q, q, q, window=(1, 0))  # five query rows: the wide key tiles of a few-row call (dispatch.tiles)
    assert p.backend == "parallel" and "1 tile of 1024 x 2048: 0 visited whole, 1 visited with a tile mask" in p.reason


def test_a_mask_that_requires_grad_runs_dense_and_gets_its_gradient():
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    mask = torch.zeros(5, 5, dtype=torch.float64, requires_grad=True)
    assert fa.explain(q, q, q, attn_mask=mask).backend == "dense"
    fa.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum().backward()
    assert mask.grad is not None


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(window=(-2, 0)), ValueError, r"window left must be -1 \(unbounded\) or at least 0, got -2"),
        (dict(window=(0, -5)), ValueError, "window right"),
        (dict(window=3), TypeError, "window must be a pair"),
        (dict(window=(1.5, 0)), TypeError, "window left must be an int"),
        (dict(softcap=-1.0), ValueError, "softcap must be a finite number > 0"),
        (dict(softcap=-1e-3), ValueError, "softcap"),
        (dict(softcap=float("inf")), ValueError, "softcap"),
        (dict(softcap=float("nan")), ValueError, "softcap"),
        (dict(softcap="1"), TypeError, "softcap must be a real number"),
        (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must have shape \(2, 4\) or \(4,\)"),
        (dict(alibi_slopes=torch.ones(4, dtype=torch.int64)), TypeError, "alibi_slopes must be floating-point"),
        (dict(alibi_slopes=[0.5] * 4), TypeError, "alibi_slopes must be a torch.Tensor"),
        (dict(seqlens_k=torch.tensor([1, 2, 3])), ValueError, r"seqlens_k must have the batch shape \(2,\)"),
        (dict(seqlens_k=torch.tensor([1.0, 2.0])), TypeError, "seqlens_k must be int32 or int64"),
        (dict(seqlens_k=torch.tensor([1, 7])), ValueError, r"seqlens_k must lie in \[0, N_k\] = \[0, 6\]"),
        (dict(seqlens_k=torch.tensor([-1, 2])), ValueError, "seqlens_k must lie in"),
    ],
)
def test_bad_mask_options_are_named(kwargs, error, match):
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 6, 8)
    with pytest.raises(error, match=match) as info:
        fa.flash_attention(q, k, k, **kwargs)
    assert isinstance(info.value, fa.AttentionError)


def test_the_parallel_path_skips_each_batch_elements_padding(monkeypatch):
    """Per head, not over the whole batch: a padded element visits only its own keys' tiles."""
    visited = count_score_tiles(monkeypatch)
    q = torch.randn(2, 1, 32, 4)
    lengths = torch.tensor([32, 8])
    parallel_attention(q, q, q, seqlens_k=lengths, block_m=8, block_n=8)
    assert len(visited) == 4 * 4 + 4 * 1  # batch 0: all 16 tiles; batch 1: key block 0 of each query block
    visited.clear()
    online_attention(q, q, q, seqlens_k=lengths, block_m=8, block_n=8)
    assert len(visited) == 16  # the query-major reference runs the batch together: the union of both


@pytest.mark.parametrize("attention", ALL)
@pytest.mark.parametrize("batch", [(), (2, 3)], ids=["rank 3", "rank 5"])
@pytest.mark.parametrize("causal_align", ["top_left", "bottom_right"])
def test_batch_shapes_other_than_one_dim_map_each_option_to_its_element(attention, batch, causal_align):
    """seqlens_k has the batch shape, slopes (*batch, H_q), the mask broadcasts: checked through the formula
    on the same problem flattened to (B, H, N, D)."""
    g = torch.Generator().manual_seed(5)
    H, N_q, N_k = 2, 7, 9
    q, k, v = (torch.randn(*batch, H, n, 4, generator=g, dtype=torch.float64) for n in (N_q, N_k, N_k))
    lengths = torch.randint(0, N_k + 1, batch, generator=g)
    slopes = torch.rand(*batch, H, generator=g, dtype=torch.float64)
    mask = torch.rand(*batch[:1], *(1,) * len(batch[1:]), 1, N_q, N_k, generator=g) > 0.3
    kw = dict(window=(3, 2), softcap=2.0, alibi_slopes=slopes, seqlens_k=lengths, attn_mask=mask)
    kw["causal_align"] = causal_align  # bottom_right: the window follows each element's length
    tiles = {} if attention is dense_attention else dict(block_m=3, block_n=4)
    O, lse = attention(q, k, v, return_lse=True, **kw, **tiles)
    flat = math.prod(batch)
    O_ref, lse_ref = formula(
        *(t.reshape(flat, H, -1, 4) for t in (q, k, v)),
        window=(3, 2),
        causal_align=causal_align,
        softcap=2.0,
        alibi_slopes=slopes.reshape(flat, H),
        seqlens_k=lengths.reshape(flat),
        attn_mask=mask.expand(*batch, 1, N_q, N_k).reshape(flat, 1, N_q, N_k),
    )
    torch.testing.assert_close(O.reshape(O_ref.shape), O_ref, atol=1e-12, rtol=0)
    assert_lse_equal(lse.reshape(lse_ref.shape), lse_ref, 1e-12)


@pytest.mark.parametrize("attention", ALL)
@pytest.mark.parametrize("causal_align", ["top_left", "bottom_right"])
def test_two_dimensional_inputs_take_a_scalar_length_and_one_slope(attention, causal_align):
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(n, 4, generator=g, dtype=torch.float64) for n in (6, 8, 8))
    kw = dict(window=(2, -1), alibi_slopes=torch.tensor([0.4], dtype=torch.float64), seqlens_k=torch.tensor(5))
    kw["causal_align"] = causal_align
    tiles = {} if attention is dense_attention else dict(block_m=4, block_n=3)
    O = attention(q, k, v, **kw, **tiles)
    O_ref, _ = formula(q[None, None], k[None, None], v[None, None], **{**kw, "seqlens_k": torch.tensor([5])})
    torch.testing.assert_close(O, O_ref[0, 0], atol=1e-12, rtol=0)
