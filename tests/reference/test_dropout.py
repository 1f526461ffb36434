"""Dropout on every CPU path: one counter-based mask, drawn tile by tile and again in the backward.

Each path is driven with a fixed key (``AttentionOptions.with_dropout(key)``) and compared with the dense
oracle at the same key: the masks must agree weight for weight, so values, ``lse`` and gradients agree to
float64 rounding for any tiling, loop order and mask, while a mask drawn at the wrong place (a tile-local
row, the key/value head instead of the query head) differs by O(1). The oracle itself is checked against
the keep mask of ``dropout.py`` written out here over the whole score matrix.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashattn_teach as fa
from flashattn_teach import dropout as dp
from flashattn_teach._options import make_options
from flashattn_teach.reference import parallel
from flashattn_teach.reference.dense import dense_forward
from flashattn_teach.reference.online import tiled_attention

from allocation_probe import LargestAllocation
from attention_strategies import Problem, problems

ORDERS = ["query_major", "key_major", "parallel"]
KEYS = st.builds(
    dp.DropoutKey,
    p=st.sampled_from([0.1, 0.5, 0.9]),
    seed=st.integers(0, 2**62),
    offset=st.sampled_from([0, 7, 2**40]),
)


def run(order: str, q, k, v, key: dp.DropoutKey, *, block_m: int = 4, block_n: int = 4, **kwargs):
    """``(O, lse)`` of one path at a fixed key; the parallel path on its pool even for small problems."""
    opts = make_options(q, k, v, **kwargs).with_dropout(key)
    if order == "dense":
        return dense_forward(q, k, v, opts)
    return tiled_attention(q, k, v, opts, order=order, block_m=block_m, block_n=block_n)


def on_the_pool():
    """The parallel path's forward and backward on worker threads, however small the problem."""
    return mock.patch.object(parallel, "MIN_PARALLEL_SCORES", 0)


def loss(O, lse):
    """A loss through ``O`` and the finite ``lse`` (rows that see no key have ``lse = -inf``)."""
    w = torch.linspace(-1, 1, O.shape[-1], dtype=O.dtype)
    return (O * w).sum() + torch.where(torch.isneginf(lse), 0.0, lse).sum()


def assert_lse_equal(lse, ref, atol=1e-12):
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref))
    finite = ~torch.isneginf(ref)
    torch.testing.assert_close(lse[finite], ref[finite], atol=atol, rtol=0)


@st.composite
def masks(draw, p: Problem) -> dict:
    """A random mix of the mask options (window, seqlens_k padding, a bool attn_mask, softcap, ALiBi)."""
    B, H_q, N_q = p.q.shape[:3]
    N_k = p.k.shape[-2]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    opts: dict = {}
    if draw(st.booleans()):
        opts["window"] = (draw(st.integers(-1, 5)), draw(st.integers(-1, 5)))
    if draw(st.booleans()):
        opts["seqlens_k"] = torch.tensor(draw(st.lists(st.integers(0, N_k), min_size=B, max_size=B)))
    if draw(st.booleans()):
        opts["attn_mask"] = torch.rand(B, 1, N_q, N_k, generator=g) < 0.7
    if draw(st.booleans()):
        opts["softcap"] = draw(st.floats(0.5, 4.0))
    if draw(st.booleans()):
        opts["alibi_slopes"] = torch.rand(H_q, generator=g, dtype=p.q.dtype)
    return opts


# ---------------------------------------------------------------------------------------- the oracle


def test_dense_oracle_drops_by_batch_query_head_row_and_column():
    """The oracle's ``O`` is ``(softmax(S) * Z / (1 - p)) V`` with ``Z`` the keep mask at ``(b * H_q + h, i, j)``,
    also when ``q`` broadcasts over the batch and heads are grouped (query head h reads k/v head h // G)."""
    g = torch.Generator().manual_seed(0)
    B, H_q, H_kv, N_q, N_k, D = 3, 4, 2, 5, 7, 3
    q = torch.randn(1, H_q, N_q, D, generator=g, dtype=torch.float64)  # broadcast over the batch
    k = torch.randn(B, H_kv, N_k, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H_kv, N_k, D, generator=g, dtype=torch.float64)
    key = dp.DropoutKey(p=0.4, seed=2**40 + 17, offset=3)
    O, lse = run("dense", q, k, v, key, enable_gqa=True)

    k_, v_ = (t.repeat_interleave(H_q // H_kv, dim=1) for t in (k, v))
    P = torch.softmax(q @ k_.transpose(-2, -1) / math.sqrt(D), dim=-1)  # (B, H_q, N_q, N_k)
    b, h, i, j = torch.meshgrid(*(torch.arange(n) for n in P.shape), indexing="ij")
    counter = key.offset + (((b * H_q + h) * N_q + i) * N_k + j)
    Z = dp.keep_mask(key, counter)
    torch.testing.assert_close(O, (P * Z / (1 - key.p)) @ v_, atol=1e-14, rtol=0)
    torch.testing.assert_close(lse, torch.logsumexp(q @ k_.transpose(-2, -1) / math.sqrt(D), dim=-1))
    assert 0.3 < 1 - Z.double().mean() < 0.5  # the mask really drops: p = 0.4 of 420 weights, SE 0.024


def test_two_dimensional_inputs_are_head_zero_of_batch_element_zero():
    q, k, v = (torch.randn(n, 3, dtype=torch.float64) for n in (6, 5, 5))
    key = dp.DropoutKey(p=0.5, seed=11)
    O, _ = run("dense", q, k, v, key)
    Z = dp.keep_mask(key, dp.counters(key, 0, torch.arange(6)[:, None], torch.arange(5)[None, :], 6, 5))
    P = torch.softmax(q @ k.T / math.sqrt(3), dim=-1)
    torch.testing.assert_close(O, (P * Z * 2) @ v, atol=1e-14, rtol=0)
    for order in ORDERS:
        torch.testing.assert_close(run(order, q, k, v, key, block_m=4, block_n=2)[0], O, atol=1e-14, rtol=0)


# --------------------------------------------------------------------------- every path against the oracle


@pytest.mark.parametrize("order", ORDERS)
@settings(max_examples=25)
@given(data=st.data(), p=problems(torch.float64, requires_grad=True), key=KEYS)
def test_every_path_equals_the_dense_oracle_at_the_same_key_float64(order, data, p, key):
    """Values, lse and the gradients of q, k, v (through O and lse), for uneven tiles, GQA, both causal
    alignments, windows, padding, a bool mask, softcap and ALiBi."""
    opts = data.draw(masks(p))
    kwargs = dict(**p.kwargs, **opts)
    O_ref, lse_ref = run("dense", p.q, p.k, p.v, key, **kwargs)
    with on_the_pool():
        O, lse = run(order, p.q, p.k, p.v, key, **p.tiles, **kwargs)
        grads = torch.autograd.grad(loss(O, lse), (p.q, p.k, p.v))
    refs = torch.autograd.grad(loss(O_ref, lse_ref), (p.q, p.k, p.v))
    torch.testing.assert_close(O, O_ref, atol=1e-12, rtol=0)
    assert_lse_equal(lse, lse_ref)
    for name, got, ref in zip("qkv", grads, refs, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=0, msg=f"d{name}")


@pytest.mark.parametrize("order", ORDERS)
@settings(max_examples=10)
@given(p=problems(torch.float32, requires_grad=True), key=KEYS)
def test_every_path_matches_the_float64_oracle_float32(order, p, key):
    with on_the_pool():
        O, lse = run(order, p.q, p.k, p.v, key, **p.tiles, **p.kwargs)
        grads = torch.autograd.grad(loss(O, lse), (p.q, p.k, p.v))
    q, k, v = (t.detach().double().requires_grad_() for t in (p.q, p.k, p.v))
    O_ref, lse_ref = run("dense", q, k, v, key, **p.kwargs)
    refs = torch.autograd.grad(loss(O_ref, lse_ref), (q, k, v))
    scale = 1 / (1 - key.p)  # survivors are scaled up, and so are their rounding errors
    torch.testing.assert_close(O.double(), O_ref, atol=2e-5 * scale, rtol=0)
    assert_lse_equal(lse.double(), lse_ref, 2e-5)
    for name, got, ref in zip("qkv", grads, refs, strict=True):
        torch.testing.assert_close(got.double(), ref, atol=2e-4 * scale, rtol=0, msg=f"d{name}")


@settings(max_examples=10)
@given(p=problems(torch.float64, requires_grad=True), key=KEYS)
def test_double_backward_equals_the_dense_oracles(p, key):
    """With ``create_graph`` the tiled backward is differentiable itself and draws the same mask."""

    def second_order(order):
        O, lse = run(order, p.q, p.k, p.v, key, **p.tiles, **p.kwargs)
        dq, dk, dv = torch.autograd.grad(loss(O, lse), (p.q, p.k, p.v), create_graph=True)
        return torch.autograd.grad((dq.square().sum() + dk.sum() + dv.square().sum()), (p.q, p.k, p.v))

    refs = second_order("dense")
    for order in ORDERS:
        for name, got, ref in zip("qkv", second_order(order), refs, strict=True):
            torch.testing.assert_close(got, ref, atol=1e-9, rtol=0, msg=f"{order} d{name}")


@settings(max_examples=10)
@given(data=st.data(), p=problems(torch.float64), key=KEYS)
def test_forward_mode_equals_the_dense_oracles(data, p, key):
    opts = data.draw(masks(p))
    g = torch.Generator().manual_seed(1)
    tangents = tuple(torch.randn(t.shape, generator=g, dtype=t.dtype) for t in (p.q, p.k, p.v))

    def finite(order):
        def f(q, k, v):
            O, lse = run(order, q, k, v, key, **p.tiles, **p.kwargs, **opts)
            return O, torch.where(torch.isneginf(lse), 0.0, lse)

        return f

    (_, (tO_ref, tlse_ref)) = torch.func.jvp(finite("dense"), (p.q, p.k, p.v), tangents)
    for order in ("query_major", "key_major"):  # the parallel path is not for torch.func transforms
        _, (tO, tlse) = torch.func.jvp(finite(order), (p.q, p.k, p.v), tangents)
        torch.testing.assert_close(tO, tO_ref, atol=1e-10, rtol=0, msg=order)
        torch.testing.assert_close(tlse, tlse_ref, atol=1e-10, rtol=0, msg=order)


@pytest.mark.parametrize("order", ORDERS)
def test_gradcheck_at_a_fixed_key(order):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 5, 2, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 1, 6, 2, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    key = dp.DropoutKey(p=0.3, seed=123456789)

    def f(q, k, v):
        O, lse = run(order, q, k, v, key, block_m=2, block_n=4, causal=True, enable_gqa=True, window=(3, -1))
        return O, lse

    with on_the_pool():
        assert torch.autograd.gradcheck(f, (q, k, v))
    if order == "query_major":  # the double backward of every order is the query-major one (autograd.py)
        assert torch.autograd.gradgradcheck(f, (q, k, v))


# ------------------------------------------------------------------------------------------- the API


def test_auto_runs_dropout_on_the_fast_path_and_explain_says_how_it_is_drawn():
    q = torch.randn(1, 2, 8, 4)
    state = torch.get_rng_state()
    for plan in (fa.explain(q, q, q, dropout_p=0.2), fa.explain(q, q, q, dropout_p=0.2, window=(2, 0))):
        assert plan.backend == "parallel"
        assert "counter-based Philox generator" in plan.reason and "draws the mask again" in plan.reason
    assert torch.equal(torch.get_rng_state(), state)  # explain draws no key
    assert fa.explain(q, q, q, dropout_p=0.2, backend="dense").backend == "dense"
    assert "Philox" not in fa.explain(q, q, q).reason


@pytest.mark.parametrize("backend", ["auto", "parallel", "query_major", "key_major", "dense"])
def test_a_call_draws_one_key_from_torchs_generator(backend):
    """``torch.manual_seed`` fixes the key, and every backend's output is the oracle's at ``dropout.draw``'s key."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 9, 4, generator=g, dtype=torch.float64) for _ in range(3))
    torch.manual_seed(7)
    O = fa.flash_attention(q, k, v, causal=True, dropout_p=0.3, backend=backend)
    after = torch.get_rng_state()
    torch.manual_seed(7)
    key = dp.draw(0.3)
    assert torch.equal(torch.get_rng_state(), after)  # one draw, no more
    torch.testing.assert_close(O, run("dense", q, k, v, key, causal=True)[0], atol=1e-13, rtol=0)


def test_manual_seed_makes_calls_repeatable_and_seeds_differ():
    q, k, v = (torch.randn(2, 2, 16, 8) for _ in range(3))

    def sdpa(seed):
        torch.manual_seed(seed)
        return fa.scaled_dot_product_attention(q, k, v, dropout_p=0.5)

    def flash(seed):
        torch.manual_seed(seed)
        return fa.flash_attention(q, k, v, dropout_p=0.5)

    for call in (sdpa, flash):
        assert torch.equal(call(1), call(1))
        assert not torch.equal(call(1), call(2))
    torch.manual_seed(3)
    first, second = fa.flash_attention(q, k, v, dropout_p=0.5), fa.flash_attention(q, k, v, dropout_p=0.5)
    assert not torch.equal(first, second)  # each call draws a fresh key


def test_dropout_p_zero_draws_nothing():
    q = torch.randn(1, 2, 8, 4)
    state = torch.get_rng_state()
    fa.flash_attention(q, q, q, dropout_p=0.0)
    fa.scaled_dot_product_attention(q, q, q, dropout_p=0.0)
    fa.reference.dense_attention(q, q, q, dropout_p=0.0)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("backend", ["parallel", "query_major", "key_major", "dense"])
def test_dropout_p_one_gives_zeros_not_nan(backend):
    q, k, v = (torch.randn(2, 2, 7, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    O = fa.flash_attention(q, k, v, causal=True, dropout_p=1.0, backend=backend)
    assert torch.equal(O, torch.zeros_like(O))
    for g in torch.autograd.grad(O.sum(), (q, k, v)):
        assert torch.equal(g, torch.zeros_like(g))


def test_sdpa_keeps_torchs_rule_dropout_whenever_p_is_positive():
    """torch's SDPA has no training flag: dropout_p > 0 drops, in eval too; only dropout_p = 0 does not."""
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    plain = fa.scaled_dot_product_attention(q, q, q)
    assert not torch.allclose(fa.scaled_dot_product_attention(q, q, q, dropout_p=0.5), plain)
    torch.testing.assert_close(fa.scaled_dot_product_attention(q, q, q, dropout_p=0.0), plain, atol=0, rtol=0)


def test_the_backward_stores_no_mask():
    """Saved for backward: q, k, v, O, lse; nothing of size N_q x N_k (the mask is drawn again)."""
    N = 64
    q, k, v = (torch.randn(1, 1, N, 4, requires_grad=True) for _ in range(3))
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        O = fa.flash_attention(q, k, v, dropout_p=0.5, backend="query_major")
    assert sizes and max(sizes) <= N * 4
    O.sum().backward()


@pytest.mark.parametrize(("path", "holds_nxn"), [*((order, False) for order in ORDERS), ("dense", True)])
def test_dropout_holds_no_score_sized_tensor_forward_or_backward(path, holds_nxn):
    """Every tensor the tiled paths allocate with dropout (counters, keep masks) is tile-sized; the dense
    oracle, the control, allocates N_q x N_k ones. The parallel path runs inline here (dispatch modes are
    per thread), the loops its pool runs."""
    N = 256
    q, k, v = (torch.randn(1, 2, N, 8, requires_grad=True) for _ in range(3))
    key = dp.DropoutKey(p=0.2, seed=77)
    with LargestAllocation() as probe:
        O, _ = run(path, q, k, v, key, block_m=32, block_n=64, causal=True)
        O.sum().backward()
    assert (probe.largest >= N * N) == holds_nxn, probe.largest


def test_dropout_is_unbiased():
    """The mean over ``n`` keys of the dropped output approaches the undropped output: each element's error
    is within 5 standard errors ``sigma / sqrt(n)`` (sigma the sample spread over keys), as a sum of ``n``
    independent draws with mean O is, by the central limit theorem, except with probability ~6e-7."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    plain = fa.flash_attention(q, k, v, causal=True)
    n = 400
    torch.manual_seed(0)
    samples = torch.stack([fa.flash_attention(q, k, v, causal=True, dropout_p=0.3) for _ in range(n)])
    mean, sigma = samples.mean(dim=0), samples.std(dim=0)
    assert (sigma > 0).all()  # every weight is dropped sometimes (row 0 sees one key: O = V_0 / 0.7 or 0)
    assert ((mean - plain).abs() <= 5 * sigma / math.sqrt(n)).all()
