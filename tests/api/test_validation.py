"""Bad input fails loudly and names the argument; edge cases have defined answers."""

from __future__ import annotations

import pytest
import torch

import flashattn_teach as fa
from flashattn_teach.reference import dense_attention, key_major_attention, online_attention

PATHS = [
    pytest.param(dense_attention, id="dense"),
    pytest.param(online_attention, id="query_major"),
    pytest.param(key_major_attention, id="key_major"),
    pytest.param(fa.flash_attention, id="flash_attention"),
    pytest.param(fa.scaled_dot_product_attention, id="sdpa"),
]


def r(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize("attention", PATHS)
@pytest.mark.parametrize(
    "q, k, v, error, words",
    [
        (r(4), r(4, 2), r(4, 2), ValueError, ["query", "at least 2 dimensions", "(4)"]),
        (r(2, 3, 4, 8), r(3, 3, 4, 8), r(3, 3, 4, 8), ValueError, ["batch", "(2, 3, 4, 8)", "(3, 3, 4, 8)"]),
        (r(1, 4, 5, 8), r(1, 3, 5, 8), r(1, 3, 5, 8), ValueError, ["heads", "(1, 4, 5, 8)", "(1, 3, 5, 8)"]),
        (r(1, 2, 5, 8), r(1, 2, 5, 4), r(1, 2, 5, 8), ValueError, ["head dimension", "(1, 2, 5, 4)"]),
        (r(1, 2, 5, 8), r(1, 2, 6, 8), r(1, 2, 5, 8), ValueError, ["sequence length", "(1, 2, 6, 8)"]),
        (r(1, 6, 5, 8), r(1, 2, 5, 8), r(1, 3, 5, 8), ValueError, ["key and value heads", "H_k=2", "H_v=3"]),
        (r(1, 2, 5, 8), r(1, 2, 5, 8, dtype=torch.float64), r(1, 2, 5, 8), TypeError, ["float32", "float64"]),
        (torch.ones(1, 2, 5, 8, dtype=torch.int64), r(1, 2, 5, 8), r(1, 2, 5, 8), TypeError, ["query", "int64"]),
        (r(1, 2, 5, 8), torch.ones(1, 2, 5, 8, dtype=torch.bool), r(1, 2, 5, 8), TypeError, ["key", "bool"]),
        (r(1, 2, 5, 8), r(1, 2, 5, 8), [[1.0]], TypeError, ["value", "list"]),
    ],
)
def test_bad_shapes_and_dtypes_name_the_argument(attention, q, k, v, error, words):
    with pytest.raises(error) as info:
        attention(q, k, v)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("attention", PATHS)
def test_gqa_needs_a_divisible_head_count(attention):
    q, kv = r(1, 6, 5, 8), r(1, 4, 5, 8)
    with pytest.raises(ValueError, match=r"H_q=6.*H_kv=4"):
        attention(q, kv, kv, enable_gqa=True)


def test_gqa_off_rejects_grouped_heads_with_a_hint():
    q, kv = r(1, 4, 5, 8), r(1, 2, 5, 8)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        fa.scaled_dot_product_attention(q, kv, kv)


def test_mixed_devices_are_rejected():
    q = r(1, 2, 5, 8)
    k = torch.empty(1, 2, 5, 8, device="meta")
    with pytest.raises(ValueError, match=r"one device.*cpu.*meta"):
        online_attention(q, k, k)


@pytest.mark.parametrize("attention", [online_attention, key_major_attention])
@pytest.mark.parametrize(
    "block_m, block_n, error, name",
    [(0, 4, ValueError, "block_m"), (4, -1, ValueError, "block_n"), (2.0, 4, TypeError, "block_m")],
)
def test_block_sizes_must_be_positive_ints(attention, block_m, block_n, error, name):
    x = r(1, 1, 5, 4)
    with pytest.raises(error, match=name):
        attention(x, x, x, block_m=block_m, block_n=block_n)


def test_mask_that_does_not_broadcast_names_both_shapes():
    x = r(2, 3, 5, 4)
    with pytest.raises(ValueError, match=r"attn_mask of shape \(4, 5\).*\(2, 3, 5, 5\)"):
        fa.scaled_dot_product_attention(x, x, x, attn_mask=torch.ones(4, 5, dtype=torch.bool))


def test_mask_dtype_is_checked_and_a_mask_with_is_causal_applies_both():
    x = r(1, 1, 5, 4)
    with pytest.raises(TypeError, match=r"attn_mask.*torch.int32"):
        fa.scaled_dot_product_attention(x, x, x, attn_mask=torch.ones(5, 5, dtype=torch.int32))
    # torch's CPU SDPA applies both (mask AND causal); so does the drop-in.
    mask = torch.rand(5, 5, generator=torch.Generator().manual_seed(0)) > 0.3
    both = fa.scaled_dot_product_attention(x, x, x, attn_mask=mask, is_causal=True)
    torch.testing.assert_close(
        both, fa.scaled_dot_product_attention(x, x, x, attn_mask=mask & torch.ones(5, 5).tril().bool())
    )
    torch.testing.assert_close(
        both, torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask, is_causal=True)
    )


def test_unknown_options_are_rejected():
    x = r(1, 1, 5, 4)
    with pytest.raises(ValueError, match="causal_align"):
        online_attention(x, x, x, causal=True, causal_align="diagonal")
    with pytest.raises(ValueError, match="backend"):
        fa.flash_attention(x, x, x, backend="cuda")
    with pytest.raises(ValueError, match="scale must be finite"):
        online_attention(x, x, x, scale=float("nan"))
    with pytest.raises(ValueError, match="dropout_p"):
        fa.scaled_dot_product_attention(x, x, x, dropout_p=1.5)


@pytest.mark.parametrize("attention", PATHS)
@pytest.mark.parametrize("N_q, N_k", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences_give_empty_or_zero_results(attention, N_q, N_k):
    q, k, v = r(2, 3, N_q, 4), r(2, 3, N_k, 4), r(2, 3, N_k, 6)
    O = attention(q, k, v)
    assert O.shape == (2, 3, N_q, 6)
    assert torch.equal(O, torch.zeros_like(O))  # no key at all: every row's answer is 0, never NaN


@pytest.mark.parametrize("attention", PATHS[:4])
def test_rows_with_no_visible_key_give_zero_and_minus_inf(attention):
    q, k, v = r(1, 2, 6, 4), r(1, 2, 2, 4), r(1, 2, 2, 4)
    kw = dict(causal=True, causal_align="bottom_right", return_lse=True)
    O, lse = attention(q, k, v, **kw)
    # N_q = 6 > N_k = 2 bottom-right: query i sees keys j <= i - 4, so rows 0-3 see nothing.
    assert torch.equal(O[..., :4, :], torch.zeros_like(O[..., :4, :]))
    assert torch.isneginf(lse[..., :4]).all() and torch.isfinite(lse[..., 4:]).all()
    assert torch.isfinite(O).all()


@pytest.mark.parametrize("attention", PATHS)
def test_nan_in_a_query_row_stays_in_that_row(attention):
    q, k, v = r(1, 2, 7, 4), r(1, 2, 9, 4), r(1, 2, 9, 4)
    q[0, 1, 3, 2] = float("nan")
    O = attention(q, k, v)
    assert torch.isnan(O[0, 1, 3]).all()
    O[0, 1, 3] = 0.0
    assert torch.isfinite(O).all()


@pytest.mark.parametrize("attention", PATHS[1:3])
def test_nan_in_a_masked_key_does_not_reach_rows_that_cannot_see_it(attention):
    q, k, v = r(1, 1, 8, 4), r(1, 1, 8, 4), r(1, 1, 8, 4)
    k[..., 6, :] = float("nan")  # seen only by queries 6 and 7 under top-left causal masking
    O = attention(q, k, v, causal=True, block_m=2, block_n=2)
    assert torch.isfinite(O[..., :6, :]).all()
    assert torch.isnan(O[..., 6:, :]).all()
