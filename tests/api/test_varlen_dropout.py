"""Dropout in ``flash_attention_varlen``: the keep mask over the packed ``total_q x total_k`` matrix.

The oracle runs each sequence alone in float64, densely, and drops its weights with the keep mask that
``flashattn_teach.dropout`` draws for the counters ``offset + (h * total_q + i) * total_k + j`` at packed row
``i = cu_seqlens_q[b] + i'`` and column ``j = cu_seqlens_k[b] + j'`` (the definition in ``varlen.py``); it
never goes through ``packed.py`` or the tile loops. The key is the one the call draws: the test reseeds torch's
generator and draws it again with :func:`flashattn_teach.dropout.draw`.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo.testing

import flashattn_teach as fa
from flashattn_teach import dropout as dp
from flashattn_teach.dispatch import planner
from flashattn_teach.ops import varlen as ops_varlen
from flashattn_teach.reference import parallel

CPU_BACKENDS = ["query_major", "key_major", "parallel", "dense"]
# (len_q, len_k): a sequence without queries, tiles cut by the boundaries, len_q < len_k and equal
LENGTHS = [(3, 5), (0, 2), (9, 11), (6, 6)]
H_Q, H_KV, D = 4, 2, 3
P = 0.3
SEED = 11


def _bounds(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _packed(dtype: torch.dtype = torch.float64):
    """``q, k, v`` packed ``(total, H, D)`` leaves and the varlen call's bounds and longest lengths."""
    g = torch.Generator().manual_seed(0)
    lq, lk = [a for a, _ in LENGTHS], [b for _, b in LENGTHS]
    q = torch.randn(sum(lq), H_Q, D, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(sum(lk), H_KV, D, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(sum(lk), H_KV, D + 1, generator=g, dtype=dtype).requires_grad_()
    return (q, k, v), (_bounds(lq), _bounds(lk), max(lq), max(lk))


def _call(q, k, v, bounds, *, seed: int = SEED, **kw) -> torch.Tensor:
    torch.manual_seed(seed)  # the call draws its key from torch's default generator
    return fa.flash_attention_varlen(q, k, v, *bounds, **kw)


def dropped_oracle(q, k, v, bounds, key: dp.DropoutKey, causal: bool) -> torch.Tensor:
    """``O (total_q, H_q, D_v)``: each sequence densely, ``softmax(S) * Z / (1 - p) @ V`` with ``Z`` the keep
    mask of the packed counters; causal bottom-right within the sequence."""
    cu_q, cu_k = bounds[0].tolist(), bounds[1].tolist()
    total_q, total_k = cu_q[-1], cu_k[-1]
    heads = torch.arange(H_Q)[:, None, None]  # (H_q, 1, 1): bh = h, one batch element
    O = []
    for b in range(len(cu_q) - 1):
        i = torch.arange(cu_q[b], cu_q[b + 1])[:, None]  # (len_q, 1), packed rows
        j = torch.arange(cu_k[b], cu_k[b + 1])[None, :]  # (1, len_k), packed columns
        qs = q[cu_q[b] : cu_q[b + 1]].transpose(0, 1)  # (H_q, len_q, D)
        ks, vs = (t[cu_k[b] : cu_k[b + 1]].transpose(0, 1).repeat_interleave(H_Q // H_KV, 0) for t in (k, v))
        S = qs @ ks.transpose(-2, -1) / math.sqrt(D)  # (H_q, len_q, D) @ (H_q, D, len_k)
        if causal:  # j' <= i' + len_k - len_q
            S = S.masked_fill((j - cu_k[b]) > (i - cu_q[b]) + (j.numel() - i.numel()), float("-inf"))
        keep = dp.keep_mask(key, dp.counters(key, heads, i, j, total_q, total_k))  # (H_q, len_q, len_k)
        P_drop = torch.where(keep, torch.softmax(S, dim=-1) * key.keep_scale, 0.0)
        O.append((P_drop @ vs).transpose(0, 1))  # (H_q, len_q, D_v) -> (len_q, H_q, D_v)
    return torch.cat(O, dim=0)


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of 4 x 3 on every tiled backend, cut by the sequences' boundaries; the parallel path on its pool."""
    monkeypatch.setattr(parallel, "MIN_PARALLEL_SCORES", 0)
    for name, (order, _, _) in dict(planner.TILED).items():
        monkeypatch.setitem(planner.TILED, name, (order, 4, 3))
    monkeypatch.setattr(planner, "FEW_ROWS", 0)  # no wide key tiles for these few rows


def _grads(O: torch.Tensor, leaves) -> list[torch.Tensor]:
    dO = torch.randn(O.shape, generator=torch.Generator().manual_seed(3), dtype=O.dtype)
    return list(torch.autograd.grad((O * dO).sum(), leaves))


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.usefixtures("small_tiles")
def test_dropout_matches_the_dense_oracle_with_the_same_keep_mask(backend: str, causal: bool) -> None:
    leaves, bounds = _packed()
    O = _call(*leaves, bounds, causal=causal, dropout_p=P, backend=backend)
    torch.manual_seed(SEED)
    O_ref = dropped_oracle(*leaves, bounds, dp.draw(P), causal)
    torch.testing.assert_close(O, O_ref, rtol=1e-12, atol=1e-12)
    for name, got, want in zip("qkv", _grads(O, leaves), _grads(O_ref, leaves), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"{backend}: d{name}")


def test_dropout_drops_by_the_seed() -> None:
    leaves, bounds = _packed()
    O = _call(*leaves, bounds, dropout_p=P)
    assert torch.equal(O, _call(*leaves, bounds, dropout_p=P))  # same seed, same mask
    assert not torch.allclose(O, _call(*leaves, bounds, dropout_p=P, seed=SEED + 1))
    assert not torch.allclose(O, _call(*leaves, bounds))  # something was dropped


def test_dropout_p_zero_is_no_dropout_and_draws_nothing() -> None:
    leaves, bounds = _packed()
    O = _call(*leaves, bounds, causal=True, dropout_p=0.0)
    after = torch.rand(())  # the generator's next draw: p = 0 consumed nothing
    torch.manual_seed(SEED)
    assert torch.equal(after, torch.rand(()))
    assert torch.equal(O, fa.flash_attention_varlen(*leaves, *bounds, causal=True))


def test_dropout_p_one_gives_zeros_and_the_undropped_lse() -> None:
    leaves, bounds = _packed()
    O, lse = _call(*leaves, bounds, dropout_p=1.0, return_lse=True)
    _, lse_plain = _call(*leaves, bounds, return_lse=True)
    assert torch.equal(O, torch.zeros_like(O))
    torch.testing.assert_close(lse, lse_plain)


def test_opcheck_passes_with_dropout() -> None:
    (q, k, v), (cu_q, cu_k, m_q, m_k) = _packed()
    flags = (True, "bottom_right", None, None, None, "query_major")
    seed = torch.tensor(123456789, dtype=torch.int64)
    torch.library.opcheck(ops_varlen.attention_varlen, (q, k, v, cu_q, cu_k, m_q, m_k, None, *flags, P, seed))


def test_compiled_dropout_is_one_graph_with_eager_masks_and_gradients() -> None:
    """The op's seed is drawn in the graph by the same ``torch.randint`` as eager's key: under the same
    torch seed the compiled call, its gradients (the backward draws the mask again) and the generator's
    state afterwards are eager's, bit for bit, for two packings, in one graph."""

    def f(q, k, v, cu_q, cu_k, m_q, m_k):
        return fa.flash_attention_varlen(q, k, v, cu_q, cu_k, m_q, m_k, causal=True, dropout_p=P)

    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(f, backend=counter, dynamic=True, fullgraph=True)
    for lengths in ([3, 9, 4, 1], [7, 2, 5, 1, 1]):  # B + 1 in {5, 6}, never a head count or D (duck sizing)
        g = torch.Generator().manual_seed(len(lengths))
        cu = torch.tensor([0, *lengths]).cumsum(0)
        q, k, v = (
            torch.randn(sum(lengths), h, D, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2)
        )
        results = []
        for fn in (compiled, f):
            torch.manual_seed(5)
            O = fn(q, k, v, cu, cu, max(lengths), max(lengths))
            results.append((O, *torch.autograd.grad(O.square().sum(), (q, k, v)), torch.rand(())))
        got, expected = results
        assert (got[0] == 0).any()  # some weights were dropped (a row keeps nothing now and then)
        for e, g_ in zip(expected, got, strict=True):
            torch.testing.assert_close(g_, e, atol=0, rtol=0)
    assert counter.frame_count == 1
