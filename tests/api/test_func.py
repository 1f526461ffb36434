"""torch.func transforms (grad, vjp, jacrev, jvp, vmap) work through every CPU backend.

Each transform is compared against the same transform of the float64 dense oracle, which is plain torch
code; the tiled backends reach the transforms through their autograd function (``setup_context`` form, a
generated vmap rule and a tiled ``jvp``).
"""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, jacrev, jvp, vjp, vmap

import flashattn_teach as fa
from flashattn_teach.reference import dense_attention, key_major_attention, online_attention

BACKENDS = ["query_major", "key_major", "dense", "auto"]
KW = {"causal": True, "causal_align": "bottom_right"}  # rows 0-1 see no key: the -inf paths are exercised


def r(*shape, seed):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def inputs():
    # N_q = 7 > N_k = 5 bottom-right: rows 0 and 1 see nothing; GQA with 4 query heads on 2 kv heads.
    return r(2, 4, 7, 3, seed=1), r(2, 2, 5, 3, seed=2), r(2, 2, 5, 4, seed=3)


def attention(backend):
    def f(q, k, v):
        return fa.flash_attention(q, k, v, **KW, backend=backend)

    return f


def oracle(q, k, v):
    return dense_attention(q, k, v, **KW, enable_gqa=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad(backend):
    def loss(f):
        return lambda q, k, v: (f(q, k, v) ** 2).sum()

    got = grad(loss(attention(backend)), argnums=(0, 1, 2))(*inputs())
    expected = grad(loss(oracle), argnums=(0, 1, 2))(*inputs())
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)
    assert got[2].abs().sum() > 0  # the gradient is not trivially zero


@pytest.mark.parametrize("backend", BACKENDS)
def test_vjp(backend):
    out, pullback = vjp(attention(backend), *inputs())
    expected_out, expected_pullback = vjp(oracle, *inputs())
    torch.testing.assert_close(out, expected_out)
    cotangent = r(*out.shape, seed=4)
    for a, b in zip(pullback(cotangent), expected_pullback(cotangent), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_jacrev(backend):
    q, k, v = (t[:1, :2] for t in inputs())  # small: the Jacobian has (7*4) x (7*3 + ...) entries
    got = jacrev(attention(backend), argnums=(0, 1, 2))(q, k, v)
    expected = jacrev(oracle, argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_jvp(backend):
    tangents = (r(2, 4, 7, 3, seed=5), r(2, 2, 5, 3, seed=6), r(2, 2, 5, 4, seed=7))
    out, t_out = jvp(attention(backend), inputs(), tangents)
    expected_out, expected_t_out = jvp(oracle, inputs(), tangents)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(t_out, expected_t_out)
    assert torch.equal(t_out[..., :2, :], torch.zeros_like(t_out[..., :2, :]))  # rows that see nothing


def test_jvp_of_lse():
    def lse(q, k, v):
        return online_attention(q, k, v, **KW, enable_gqa=True, block_m=3, block_n=2, return_lse=True)[1]

    def lse_oracle(q, k, v):
        return dense_attention(q, k, v, **KW, enable_gqa=True, return_lse=True)[1]

    tangents = (r(2, 4, 7, 3, seed=5), r(2, 2, 5, 3, seed=6), r(2, 2, 5, 4, seed=7))
    _, got = jvp(lse, inputs(), tangents)
    _, expected = jvp(lse_oracle, inputs(), tangents)
    torch.testing.assert_close(got[..., 2:], expected[..., 2:])
    assert torch.equal(got[..., :2], torch.zeros_like(got[..., :2]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("in_dims", [(0, 0, 0), (0, None, None)])
def test_vmap(backend, in_dims):
    q, k, v = inputs()
    if in_dims[1] is None:
        k, v = k[0], v[0]
    got = vmap(attention(backend), in_dims=in_dims)(q, k, v)
    expected = vmap(oracle, in_dims=in_dims)(q, k, v)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("reference", [online_attention, key_major_attention])
def test_vmap_of_the_references_with_small_tiles(reference):
    q, k, v = inputs()
    got = vmap(lambda q, k, v: reference(q, k, v, **KW, enable_gqa=True, block_m=2, block_n=3))(q, k, v)
    torch.testing.assert_close(got, oracle(q, k, v))


def test_auto_runs_in_this_thread_under_a_transform():
    plans = []

    def f(q, k, v):
        plans.append(fa.explain(q, k, v, enable_gqa=True).backend)
        return fa.flash_attention(q, k, v)

    vmap(f)(*inputs())
    assert plans == ["query_major"]
    assert fa.explain(*(t[0] for t in inputs()), enable_gqa=True).backend == "parallel"
    with pytest.raises(NotImplementedError, match=r"torch\.func"):
        vmap(attention("parallel"))(*inputs())
