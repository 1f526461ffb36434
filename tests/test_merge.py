"""merge_attention_states: attention over a split key set equals attention over the whole, in any order."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flashattn_teach as fa
from flashattn_teach.reference import dense_attention


def r(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def part(q, k, v, cols, **kw):
    """``(O, lse)`` of the queries over the key columns ``cols`` only (the dense oracle on a slice)."""
    return dense_attention(q, k[..., cols, :], v[..., cols, :], return_lse=True, **kw)


@given(
    N_q=st.integers(1, 9),
    N_k=st.integers(2, 12),
    cut=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([None, 3.0, 40.0]),
)
def test_merging_two_key_ranges_equals_attention_over_both(N_q, N_k, cut, seed, scale):
    q, k, v = r(2, 3, N_q, 4, seed=seed), r(2, 3, N_k, 4, seed=seed + 1), r(2, 3, N_k, 5, seed=seed + 2)
    c = round(cut * N_k)  # 0 or N_k leaves one side empty: lse = -inf there
    O_a, lse_a = part(q, k, v, slice(0, c), scale=scale)
    O_b, lse_b = part(q, k, v, slice(c, N_k), scale=scale)
    O, lse = fa.merge_attention_states(O_a, lse_a, O_b, lse_b)
    O_ref, lse_ref = dense_attention(q, k, v, return_lse=True, scale=scale)
    torch.testing.assert_close(O, O_ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, lse_ref, atol=1e-12, rtol=1e-12)


@given(cuts=st.lists(st.integers(0, 11), min_size=2, max_size=2), seed=st.integers(0, 2**16))
def test_merge_is_associative_and_commutative(cuts, seed):
    q, k, v = r(1, 2, 6, 4, seed=seed), r(1, 2, 11, 4, seed=seed + 1), r(1, 2, 11, 3, seed=seed + 2)
    c1, c2 = sorted(cuts)
    a, b, c = (part(q, k, v, s) for s in (slice(0, c1), slice(c1, c2), slice(c2, 11)))
    left = fa.merge_attention_states(*fa.merge_attention_states(*a, *b), *c)
    right = fa.merge_attention_states(*a, *fa.merge_attention_states(*b, *c))
    swapped = fa.merge_attention_states(*c, *fa.merge_attention_states(*b, *a))
    for x, y in ((left, right), (left, swapped)):
        torch.testing.assert_close(x[0], y[0], atol=1e-13, rtol=1e-13)
        torch.testing.assert_close(x[1], y[1], atol=1e-13, rtol=1e-13)
    O_ref, lse_ref = dense_attention(q, k, v, return_lse=True)
    torch.testing.assert_close(left[0], O_ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(left[1], lse_ref, atol=1e-12, rtol=1e-12)


@given(
    cuts=st.lists(st.integers(0, 13), min_size=0, max_size=6),
    order=st.randoms(use_true_random=False),
    seed=st.integers(0, 2**16),
)
def test_merging_k_partial_results_in_any_grouping_equals_one_pass(cuts, order, seed):
    # k = len(cuts) + 1 key ranges (some empty), merged pairwise in a random tree: any two of the partial
    # results so far, in either argument order, until one is left.
    q, k, v = r(2, 2, 5, 4, seed=seed), r(2, 2, 13, 4, seed=seed + 1), r(2, 2, 13, 3, seed=seed + 2)
    bounds = [0, *sorted(cuts), 13]
    partials = [part(q, k, v, slice(a, b)) for a, b in itertools.pairwise(bounds)]
    while len(partials) > 1:
        a, b = order.sample(range(len(partials)), 2)
        merged = fa.merge_attention_states(*partials[a], *partials[b])
        partials = [p for i, p in enumerate(partials) if i not in (a, b)] + [merged]
    O, lse = partials[0]
    O_ref, lse_ref = dense_attention(q, k, v, return_lse=True)
    torch.testing.assert_close(O, O_ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, lse_ref, atol=1e-12, rtol=1e-12)


def test_rows_that_see_nothing_on_either_side_give_zero_and_minus_inf_without_nan_gradients():
    # Bottom-right causal with N_q = 6 > N_k = 4: rows 0-1 see no key at all; split keys 0-1 | 2-3.
    q, k, v = (r(1, 1, n, 4, seed=s).requires_grad_() for s, n in ((1, 6), (2, 4), (3, 4)))
    kw = {"causal": True, "causal_align": "bottom_right"}
    O_ref, lse_ref = dense_attention(q, k, v, return_lse=True, **kw)
    # Each side keeps the full-sequence causal geometry: mask the other half's columns instead of slicing.
    visible = torch.ones(6, 4, dtype=torch.bool).tril(diagonal=-2)
    halves = [torch.zeros(4, dtype=torch.bool), torch.zeros(4, dtype=torch.bool)]
    halves[0][:2], halves[1][2:] = True, True
    sides = [dense_attention(q, k, v, attn_mask=visible & h, return_lse=True) for h in halves]
    O, lse = fa.merge_attention_states(*sides[0], *sides[1])
    torch.testing.assert_close(O, O_ref)
    torch.testing.assert_close(lse, lse_ref)
    assert torch.equal(O[..., :2, :], torch.zeros_like(O[..., :2, :])) and torch.isneginf(lse[..., :2]).all()
    O.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("backend", ["parallel", "query_major", "key_major", "dense"])
def test_split_kv_from_two_calls_gives_the_one_calls_gradients_with_empty_rows(backend):
    """Split-KV by hand: two ``flash_attention(return_lse=True)`` calls over the two halves of the keys,
    merged. Rows 0-1 see no key on either side (bottom-right causal, N_q = 6 > N_k = 4); their gradients are
    zero, as the one call over all keys gives, not NaN."""
    q, k, v = (r(1, 2, n, 4, seed=s).requires_grad_() for s, n in ((1, 6), (2, 4), (3, 4)))
    visible = torch.ones(6, 4, dtype=torch.bool).tril(diagonal=-2)  # bottom-right causal, offset -2
    halves = torch.zeros(2, 4, dtype=torch.bool)
    halves[0, :2], halves[1, 2:] = True, True
    sides = [fa.flash_attention(q, k, v, attn_mask=visible & h, backend=backend, return_lse=True) for h in halves]
    O, lse = fa.merge_attention_states(*sides[0], *sides[1])
    (O.square().sum() + lse.masked_fill(lse.isneginf(), 0.0).sum()).backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    O_one, lse_one = fa.flash_attention(q, k, v, attn_mask=visible, backend=backend, return_lse=True)
    (O_one.square().sum() + lse_one.masked_fill(lse_one.isneginf(), 0.0).sum()).backward()
    for g, t in zip(got, (q, k, v), strict=True):
        torch.testing.assert_close(g, t.grad)
    assert torch.equal(got[0][..., :2, :], torch.zeros_like(got[0][..., :2, :]))


def test_the_merged_lse_of_two_empty_sides_has_zero_gradient():
    lse_a = torch.tensor([float("-inf"), 0.5], dtype=torch.float64, requires_grad=True)
    lse_b = torch.tensor([float("-inf"), -1.0], dtype=torch.float64, requires_grad=True)
    O_a, O_b = torch.ones(2, 3, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64)
    O, lse = fa.merge_attention_states(O_a, lse_a, O_b, lse_b)
    assert torch.isneginf(lse[0]) and torch.equal(O[0], torch.zeros(3, dtype=torch.float64))
    (lse * torch.tensor([1.0, 1.0], dtype=torch.float64)).sum().backward()
    assert lse_a.grad[0] == 0 and lse_b.grad[0] == 0
    torch.testing.assert_close(lse_a.grad[1] + lse_b.grad[1], torch.tensor(1.0, dtype=torch.float64))


def test_an_empty_side_is_ignored_even_if_its_output_holds_nan():
    O_a, lse_a = r(2, 5, 3, seed=1), r(2, 5, seed=2)
    O_b, lse_b = torch.full((2, 5, 3), float("nan"), dtype=torch.float64), torch.full((2, 5), float("-inf"))
    O, lse = fa.merge_attention_states(O_a, lse_a, O_b, lse_b.double())
    torch.testing.assert_close(O, O_a)
    torch.testing.assert_close(lse, lse_a)


def test_gradcheck():
    O_a, lse_a, O_b, lse_b = (r(*s, seed=i).requires_grad_() for i, s in enumerate([(3, 4), (3,), (3, 4), (3,)]))
    assert torch.autograd.gradcheck(fa.merge_attention_states, (O_a, lse_a, O_b, lse_b))


def test_low_precision_outputs_merge_in_float32():
    q, k, v = r(1, 2, 7, 8, seed=1), r(1, 2, 9, 8, seed=2), r(1, 2, 9, 8, seed=3)
    a, b = part(q, k, v, slice(0, 4)), part(q, k, v, slice(4, 9))
    O, lse = fa.merge_attention_states(a[0].bfloat16(), a[1].float(), b[0].bfloat16(), b[1].float())
    assert O.dtype == torch.bfloat16 and lse.dtype == torch.float32
    O_ref, lse_ref = dense_attention(q, k, v, return_lse=True)
    torch.testing.assert_close(O.double(), O_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "args, error, words",
    [
        ((None, "lse"), TypeError, "o_a must be a floating-point torch.Tensor, got NoneType"),
        (("o_b_shape",), ValueError, "o_a and o_b must have one shape and dtype"),
        (("lse_shape",), ValueError, "lse_a and lse_b must have o's shape without its last dim"),
        (("int",), TypeError, "lse_b must be a floating-point torch.Tensor, got a torch.int64 tensor"),
    ],
)
def test_bad_input_names_the_argument(args, error, words):
    O, lse = r(2, 5, 3, seed=1), r(2, 5, seed=2)
    inputs = {
        None: (None, lse, O, lse),
        "o_b_shape": (O, lse, O[:, :4], lse),
        "lse_shape": (O, lse, O, lse[:, :4]),
        "int": (O, lse, O, lse.long()),
    }[args[0]]
    with pytest.raises(error, match=words) as info:
        fa.merge_attention_states(*inputs)
    assert isinstance(info.value, fa.AttentionError)
