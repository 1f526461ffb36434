"""The drop-in behaves as torch 2.13's ``scaled_dot_product_attention`` wherever torch defines a behaviour.

Each test pins one finding of the hardening review: torch's own function is the expected value, called
side by side, so these tests fail if either side changes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flashattn_teach as fa
from flashattn_teach.reference import dense_attention, flash_backward, key_major_attention, online_attention


def r(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


SDPA_BACKENDS = ["auto", "parallel", "query_major", "key_major", "dense"]


def sdpa(backend: str):
    """The drop-in's signature with a backend forced (``auto`` is the drop-in itself)."""
    if backend == "auto":
        return fa.scaled_dot_product_attention

    def call(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        assert attn_mask is None and dropout_p == 0.0
        return fa.flash_attention(q, k, v, causal=is_causal, scale=scale, enable_gqa=enable_gqa, backend=backend)

    return call


@pytest.mark.parametrize("backend", SDPA_BACKENDS)
@pytest.mark.parametrize(
    "q_shape, kv_shape, enable_gqa",
    [
        ((1, 1, 5, 8), (1, 4, 7, 8), False),  # one query head broadcasts over four key/value heads
        ((5, 8), (1, 4, 7, 8), False),  # 2-D query against 4-D keys
        ((4, 5, 8), (1, 4, 7, 8), False),  # 3-D query: its leading dim meets the heads
        ((2, 4, 5, 8), (2, 1, 7, 8), False),  # multi-query
        ((2, 4, 5, 8), (2, 2, 7, 8), True),  # grouped-query
        ((1, 0, 5, 8), (1, 0, 7, 8), False),  # zero heads
        ((0, 2, 5, 8), (0, 2, 7, 8), False),  # zero batch
    ],
)
def test_shapes_broadcast_as_in_torch(backend, q_shape, kv_shape, enable_gqa):
    q, k, v = r(*q_shape, seed=1), r(*kv_shape, seed=2), r(*kv_shape, seed=3)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa)
    got = sdpa(backend)(q, k, v, enable_gqa=enable_gqa)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("backend", SDPA_BACKENDS)
def test_key_and_value_heads_broadcast_and_gradients_sum_back(backend):
    q, k, v = (r(2, 4, 5, 8, seed=1), r(2, 4, 7, 8, seed=2), r(2, 1, 7, 6, seed=3))
    q1 = q[:, :1].clone()  # one query head as well
    ins = [t.clone().requires_grad_() for t in (q1, k, v)]
    ref = [t.clone().requires_grad_() for t in (q1, k, v)]
    out = sdpa(backend)(*ins)
    expected = F.scaled_dot_product_attention(*ref)
    torch.testing.assert_close(out, expected)
    dO = r(*out.shape, seed=4)
    out.backward(dO)
    expected.backward(dO)
    for a, b in zip(ins, ref, strict=True):
        assert a.grad.shape == a.shape
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("backend", SDPA_BACKENDS)
def test_head_dim_zero_gives_the_mean_of_v(backend):
    q, k, v = r(1, 2, 5, 0), r(1, 2, 7, 0), r(1, 2, 7, 3)
    got = sdpa(backend)(q, k, v)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v))
    torch.testing.assert_close(got, v.mean(dim=-2, keepdim=True).expand(1, 2, 5, 3))


@pytest.mark.parametrize("name, kwargs", [
    ("is_causal", {"is_causal": "no"}),
    ("is_causal", {"is_causal": None}),
    ("is_causal", {"is_causal": 1}),
    ("enable_gqa", {"enable_gqa": "yes"}),
    ("dropout_p", {"dropout_p": "0.1"}),
    ("scale", {"scale": "0.5"}),
    ("scale", {"scale": torch.tensor([0.5, 0.2])}),
])  # fmt: skip
def test_flags_and_numbers_of_the_wrong_type_raise_type_error_as_torch_does(name, kwargs):
    q = r(1, 2, 5, 8)
    with pytest.raises(TypeError, match=name):
        F.scaled_dot_product_attention(q, q, q, **kwargs)
    with pytest.raises(TypeError, match=name) as info:
        fa.scaled_dot_product_attention(q, q, q, **kwargs)
    assert isinstance(info.value, RuntimeError)  # code written for torch may catch RuntimeError


@pytest.mark.parametrize("scale", [torch.tensor(0.5), np.float32(0.5), np.float64(0.5), 1, 0.0, -0.3])
def test_scale_accepts_what_torch_accepts(scale):
    q, k, v = r(1, 2, 5, 8, seed=1), r(1, 2, 6, 8, seed=2), r(1, 2, 6, 8, seed=3)
    expected = F.scaled_dot_product_attention(q, k, v, scale=scale)
    torch.testing.assert_close(fa.scaled_dot_product_attention(q, k, v, scale=scale), expected)
    torch.testing.assert_close(fa.flash_attention(q, k, v, scale=scale, backend="query_major"), expected)


@pytest.mark.parametrize("dropout_p", [torch.tensor(0.0), np.float64(0.0), 0])
def test_dropout_p_accepts_numbers_and_tensors(dropout_p):
    q = r(1, 2, 5, 8)
    torch.testing.assert_close(
        fa.scaled_dot_product_attention(q, q, q, dropout_p=dropout_p), F.scaled_dot_product_attention(q, q, q)
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask_dtype", ["query", torch.float32])
def test_additive_mask_in_float32_or_the_query_dtype_with_low_precision_inputs(dtype, mask_dtype):
    q, k, v = (r(1, 2, 5, 8, dtype=torch.float32, seed=s).to(dtype) for s in (1, 2, 3))
    mask = torch.zeros(5, 6, dtype=dtype if mask_dtype == "query" else mask_dtype)
    mask[:, 4:] = float("-inf")
    mask[:, 0] = -1.5
    k, v = torch.cat([k, k[..., :1, :]], dim=-2), torch.cat([v, v[..., :1, :]], dim=-2)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert got.dtype == dtype
    # Both round to the low precision at the end; the float64 oracle bounds each side.
    oracle = dense_attention(q.double(), k.double(), v.double(), attn_mask=mask.double())
    err_ours, err_torch = (got.double() - oracle).abs().max(), (expected.double() - oracle).abs().max()
    assert err_ours <= 2 * err_torch + 1e-3


@pytest.mark.parametrize("mask_dtype", [torch.float64, torch.int64, torch.float16])
def test_other_mask_dtypes_are_refused_as_torch_refuses_them(mask_dtype):
    q = r(1, 2, 5, 8, dtype=torch.float32)
    mask = torch.zeros(5, 5, dtype=mask_dtype)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    with pytest.raises(TypeError, match=r"attn_mask must be bool, float32 or query's dtype"):
        fa.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def test_an_all_true_mask_changes_nothing_even_beyond_float32_range():
    # q @ k^T = 4e38 overflows float32 (max 3.4e38); (scale * q) @ k^T = 4e18 does not. Every path scales q
    # first, so adding a mask that hides nothing (the dense path) gives the same finite answer.
    q = torch.full((1, 1, 3, 4), 1e19)
    k = torch.full((1, 1, 3, 4), 1e19)
    v = r(1, 1, 3, 4, dtype=torch.float32)
    plain = fa.scaled_dot_product_attention(q, k, v, scale=1e-20)
    everything = torch.ones(3, 3, dtype=torch.bool)
    masked = fa.scaled_dot_product_attention(q, k, v, scale=1e-20, attn_mask=everything)  # a tiled path
    dense = fa.flash_attention(q, k, v, scale=1e-20, attn_mask=everything, backend="dense")
    assert fa.explain(q, k, v, attn_mask=everything).backend != "dense"
    assert torch.isfinite(plain).all() and torch.isfinite(masked).all() and torch.isfinite(dense).all()
    torch.testing.assert_close(plain, masked)
    torch.testing.assert_close(plain, dense)
    torch.testing.assert_close(plain, v.mean(dim=-2, keepdim=True).expand_as(plain))  # equal scores


@pytest.mark.parametrize(
    "call",
    [
        lambda q: fa.scaled_dot_product_attention(q, q[..., :4], q),  # head dims differ
        lambda q: fa.scaled_dot_product_attention(q, q[:, :3], q[:, :3]),  # 4 heads vs 3
        lambda q: fa.scaled_dot_product_attention(q, q, q, dropout_p=1.5),
        lambda q: fa.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(3, 6)),
        lambda q: fa.flash_attention(q, q, q, causal_align="diagonal"),
        lambda q: fa.flash_attention(q, q, q, backend="cuda"),
        lambda q: online_attention(q, q, q, block_m=0),
    ],
)
def test_errors_are_value_errors_and_runtime_errors(call):
    q = r(1, 4, 5, 8)
    with pytest.raises(ValueError) as info:
        call(q)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, fa.AttentionError)


@pytest.mark.parametrize("missing", ["o", "lse", "do", "dlse"])
def test_flash_backward_names_a_missing_tensor(missing):
    q = r(1, 2, 5, 8)
    O, lse = online_attention(q, q, q, return_lse=True)
    args = {"o": O, "lse": lse, "do": torch.ones_like(O), "dlse": torch.ones_like(lse)}
    args[missing] = None if missing != "dlse" else "not a tensor"
    with pytest.raises(TypeError, match=rf"^{missing} must be a floating-point torch.Tensor"):
        flash_backward(q, q, q, args["o"], args["lse"], args["do"], dlse=args["dlse"])


def test_flash_backward_names_a_tensor_of_the_wrong_shape():
    q = r(1, 2, 5, 8)
    O, lse = online_attention(q, q, q, return_lse=True)
    with pytest.raises(ValueError, match=r"lse must have shape \(1, 2, 5\), got \(1, 2, 4\)"):
        flash_backward(q, q, q, O, lse[..., :4], O)


def test_rows_that_see_nothing_give_zero_as_torch_does():
    q, k, v = r(1, 2, 5, 8, seed=1), r(1, 2, 6, 8, seed=2), r(1, 2, 6, 8, seed=3)
    mask = torch.ones(5, 6, dtype=torch.bool)
    mask[2] = False
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(fa.scaled_dot_product_attention(q, k, v, attn_mask=mask), expected)
    assert torch.equal(expected[..., 2, :], torch.zeros_like(expected[..., 2, :]))


def test_deprecated_key_major_name_warns_and_still_works():
    q = r(1, 2, 5, 8)
    with pytest.warns(DeprecationWarning, match="key_major_attention"):
        old = fa.keymajor_attention(q, q, q)
    torch.testing.assert_close(old, key_major_attention(q, q, q))


@pytest.mark.parametrize("backend", ["auto", "parallel", "query_major", "key_major"])
def test_second_derivatives_through_the_tiled_backward(backend):
    # Large enough for the parallel path's worker pool; the extra q**3 term keeps the graph alive.
    q, k = r(1, 2, 300, 16, seed=1).requires_grad_(), r(1, 2, 300, 16, seed=2)

    def loss(attention):
        return attention(q, k, k).square().sum() + q.pow(3).sum()

    (g,) = torch.autograd.grad(loss(lambda *a: fa.flash_attention(*a, backend=backend)), q, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), q)
    (g_ref,) = torch.autograd.grad(loss(dense_attention), q, create_graph=True)
    (gg_ref,) = torch.autograd.grad(g_ref.sum(), q)
    torch.testing.assert_close(gg, gg_ref)


@pytest.mark.parametrize("bad", [None, np.zeros((1, 2, 5, 8)), [[1.0]]])
@pytest.mark.parametrize(
    "call",
    [fa.scaled_dot_product_attention, fa.flash_attention, fa.explain, dense_attention, online_attention],
)
def test_a_query_that_is_not_a_tensor_is_named(call, bad):
    k = r(1, 2, 5, 8)
    with pytest.raises(TypeError, match=r"^query must be a torch\.Tensor"):
        call(bad, k, k)


def test_zero_key_value_heads_against_several_query_heads_is_an_error_not_a_crash():
    with pytest.raises(ValueError, match=r"query has 4 heads but key/value have 0"):
        fa.scaled_dot_product_attention(r(1, 4, 5, 8), r(1, 0, 7, 8), r(1, 0, 7, 8))


def test_a_scale_that_requires_grad_is_refused_as_torch_refuses_it():
    q = r(1, 2, 5, 8)
    scale = torch.tensor(0.5, requires_grad=True)
    with pytest.raises(TypeError):
        F.scaled_dot_product_attention(q, q, q, scale=scale)
    with pytest.raises(TypeError, match="scale must not require grad"):
        fa.scaled_dot_product_attention(q, q, q, scale=scale)


def test_scale_and_enable_gqa_are_keyword_only_as_in_torch():
    q = r(1, 2, 5, 8)
    with pytest.raises(TypeError):
        F.scaled_dot_product_attention(q, q, q, None, 0.0, False, 0.5)
    with pytest.raises(TypeError):
        fa.scaled_dot_product_attention(q, q, q, None, 0.0, False, 0.5)  # type: ignore[misc]


def test_return_lse_must_be_a_bool():
    q = r(1, 2, 5, 8)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        fa.flash_attention(q, q, q, return_lse="yes")  # type: ignore[call-overload]
