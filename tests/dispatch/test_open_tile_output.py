"""The one open tile when the caller drops ``lse`` (issue 38, host cost): ``flash_attention`` without
``return_lse`` and the SDPA drop-in run it without ``lse``'s four torch ops (``dispatch/runner.py run``'s
``with_lse``), on ``(B H, N, D)`` views and ``torch.bmm`` where ``q, k, v`` share their leading dimensions,
with the scale a kept 0-d tensor (``reference/scores.scale_tensor``). Each path against the float64 dense
oracle and torch's SDPA, and shown to be taken; ``O`` is bitwise the one the ``lse`` path gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashattn_teach as fa
from flashattn_teach._options import make_options
from flashattn_teach.dispatch import planner, runner
from flashattn_teach.reference import autograd, dense_attention, scores
from flashattn_teach.reference.scores import NO_LSE, scale_tensor


def _tensors(*shapes, dtype=torch.float64, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad) for s in shapes]


@pytest.fixture
def tiles(monkeypatch):
    """``with_lse`` of every open tile run (``whole_row`` calls)."""
    calls = []
    whole_row = autograd.whole_row

    def recorded(S, v, out=None, *, with_lse=True, bmm=False):
        calls.append(with_lse)
        return whole_row(S, v, out, with_lse=with_lse, bmm=bmm)

    monkeypatch.setattr(autograd, "whole_row", recorded)
    return calls


# (q, k, v) shapes: the first four share their leading dimensions (bmm on views), the rest broadcast (matmul)
LAYOUTS = {
    "(1, 8, 16, 64)": ((1, 8, 16, 64), (1, 8, 16, 64), (1, 8, 16, 64)),
    "2-D": ((7, 16), (9, 16), (9, 8)),
    "3-D, D_v != D": ((5, 7, 16), (5, 9, 16), (5, 9, 8)),
    "(2, 3, 5, 6, 8), 5-D": ((2, 3, 5, 6, 8), (2, 3, 5, 9, 8), (2, 3, 5, 9, 8)),
    "one key/value head": ((2, 4, 6, 16), (2, 1, 9, 16), (2, 1, 9, 16)),
    "3-D, one key/value head": ((4, 6, 16), (1, 9, 16), (1, 9, 8)),  # bmm would not broadcast it
    "batch broadcast": ((1, 4, 6, 16), (3, 4, 9, 16), (3, 4, 9, 16)),
    "ranks differ": ((4, 6, 16), (2, 4, 9, 16), (2, 4, 9, 16)),
    "(B, N, H, D) transposed": "bnhd",  # flash-attn's layout, read as torch's: q's strides are not contiguous
}


def _layout(layout, dtype=torch.float64, grad=False):
    if LAYOUTS[layout] == "bnhd":
        return [t.transpose(1, 2) for t in _tensors((2, 6, 4, 16), (2, 9, 4, 16), (2, 9, 4, 16), dtype=dtype)]
    return _tensors(*LAYOUTS[layout], dtype=dtype, grad=grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_call_that_drops_lse_skips_it_and_gives_the_same_O(layout, dtype, tiles):
    q, k, v = _layout(layout, dtype)
    O_ref = dense_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    O = fa.flash_attention(q, k, v)  # no grad reaches it: the forward alone, no lse
    O_lse, lse = fa.flash_attention(q, k, v, return_lse=True)
    assert tiles == [False, True]  # both took the open tile, the first without lse
    assert torch.equal(O, O_lse)  # the same ops for O on both
    tol = {"atol": 1e-12, "rtol": 1e-10} if dtype == torch.float64 else {"atol": 2e-6, "rtol": 1e-5}
    torch.testing.assert_close(O.double(), O_ref, **tol)
    torch.testing.assert_close(lse.double(), torch.logsumexp(_scores(q, k), dim=-1), **tol)


def _scores(q, k):
    """The float64 scores ``scale q k^T`` of a call without a mask, heads broadcast as torch.matmul does."""
    q, k = q.double(), k.double()
    return q @ k.mT / q.shape[-1] ** 0.5


@pytest.mark.parametrize("layout", ["(1, 8, 16, 64)", "3-D, D_v != D", "one key/value head", "(B, N, H, D) transposed"])
def test_the_drop_in_skips_lse_and_matches_torch(layout, tiles):
    q, k, v = _layout(layout, torch.float32)
    O = fa.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(O, F.scaled_dot_product_attention(q, k, v, enable_gqa=True), atol=2e-6, rtol=1e-5)
    assert tiles == [False]


def test_with_grad_the_open_tile_keeps_lse_and_the_gradients(tiles):
    q, k, v = _tensors((1, 8, 16, 64), (1, 8, 16, 64), (1, 8, 16, 64), grad=True)
    O = fa.flash_attention(q, k, v)  # the backward reads lse: the autograd function computes it
    O_ref = dense_attention(q, k, v)
    dO = torch.randn_like(O)
    torch.testing.assert_close(O, O_ref, atol=1e-12, rtol=1e-10)
    grads = torch.autograd.grad((O * dO).sum(), (q, k, v))
    for g, g_ref in zip(grads, torch.autograd.grad((O_ref * dO).sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(g, g_ref, atol=1e-10, rtol=1e-8)
    assert tiles == [True]


def test_a_folded_call_keeps_lse_for_unfold(tiles):
    """One query per head under grouped-query attention runs as rows of its key/value head (``rows.py``),
    whose ``unfold`` reads ``lse``: computed there even when the caller drops it."""
    q, k, v = _tensors((2, 8, 1, 16), (2, 2, 9, 16), (2, 2, 9, 16))
    O = fa.flash_attention(q, k, v)
    torch.testing.assert_close(O, dense_attention(q, k, v, enable_gqa=True), atol=1e-12, rtol=1e-10)
    assert tiles == [True]


def test_the_runner_gives_no_lse_only_for_the_open_tile_without_grad():
    q, k, v = _tensors((1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16))
    for kw in ({}, {"causal": True}):  # the open tile; the tile loop (which computes lse whatever is asked)
        opts = make_options(q, k, v, **kw)
        p = planner.plan(q, k, v, opts)
        O, lse = runner.run(p, q, k, v, opts, False)
        O_all, lse_all = runner.run(p, q, k, v, opts)
        assert torch.equal(O, O_all)
        assert (lse is NO_LSE) == (not kw)
        if kw:
            assert torch.equal(lse, lse_all)


@pytest.mark.parametrize("shapes", [((0, 2, 4, 8),) * 3, ((1, 2, 0, 8), (1, 2, 5, 8), (1, 2, 5, 8))])
def test_empty_calls_match_torch(shapes):
    q, k, v = _tensors(*shapes, dtype=torch.float32)
    O = fa.flash_attention(q, k, v)
    assert O.shape == F.scaled_dot_product_attention(q, k, v).shape


def test_the_open_tile_under_autocast_without_lse(tiles):
    q, k, v = _tensors((1, 4, 10, 32), (1, 4, 12, 32), (1, 4, 12, 32), dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        O = fa.flash_attention(q, k, v)
    O_ref = dense_attention(*(t.to(torch.bfloat16).double() for t in (q, k, v)))
    assert O.dtype == torch.bfloat16 and tiles == [False]
    torch.testing.assert_close(O.double(), O_ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [0.125, 1 / 3, 1e-30, 7.0])
def test_the_kept_scale_multiplies_as_the_python_number(scale, dtype):
    (q,) = _tensors((3, 5, 16), dtype=dtype)
    assert torch.equal(q * scale_tensor(scale, dtype), q * scale)
    assert scale_tensor(scale, dtype) is scale_tensor(scale, dtype)  # kept, not built again


def test_the_kept_scales_are_bounded():
    for n in range(200):
        scale_tensor(1.0 + n, torch.float32)
        assert len(scores._SCALES) <= 64


def test_fake_tensors_take_the_scale_as_a_number():
    """A tensor subclass (here FakeTensor, as shape propagation and export make them) refuses the kept real
    0-d scale as an operand: it takes the Python number, and the call gives torch's output shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.randn(1, 8, 16, 64), torch.randn(1, 8, 16, 64), torch.randn(1, 8, 16, 32)
        O = fa.flash_attention(q, k, v)
        assert O.shape == (1, 8, 16, 32) and O.dtype == torch.float32
