"""One query per head (rows.py): the query heads of a key/value head run as rows of it when nothing but their
query vectors tells them apart; results and gradients against the float64 dense oracle, and the cases that
must not fold."""

from __future__ import annotations

import pytest
import torch

import flashattn_teach as fa
from flashattn_teach.dispatch import runner
from flashattn_teach.reference import dense_attention


def _qkv(B=2, H_q=8, H_kv=2, N_k=300, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_q, 1, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, H_kv, N_k, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, H_kv, N_k, D, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, v


def _padding(B, N_k, heads=1):
    mask = torch.ones(B, heads, 1, N_k, dtype=torch.bool)
    mask[1, ..., :70] = False  # left padding of element 1
    if heads > 1:
        mask[0, 3, ..., 200:] = False  # one query head of element 0 sees fewer keys
    return mask


def _recorded_query_shapes(monkeypatch):
    seen = []
    tiled = runner.TiledAttentionFunction.forward

    def recording(q, *args):
        seen.append(tuple(q.shape))
        return tiled(q, *args)

    monkeypatch.setattr(runner.TiledAttentionFunction, "forward", staticmethod(recording))
    return seen


CASES = {
    "plain": {},
    "padding mask": {"attn_mask": "padding"},
    "a mask per query head": {"attn_mask": "per head"},
    "additive mask": {"attn_mask": "additive"},
    "bottom-right causal": {"causal": True, "causal_align": "bottom_right"},
    "softcap and seqlens_k": {"softcap": 3.0, "seqlens_k": torch.tensor([300, 123])},
    # each row sits at its own element's last key, L_b - 1: it sees all of that element's keys
    "bottom-right causal and seqlens_k": {
        "causal": True,
        "causal_align": "bottom_right",
        "seqlens_k": torch.tensor([300, 123]),
    },
    "a window that hides no key": {"window": (400, 0), "causal_align": "bottom_right"},
}


@pytest.mark.parametrize("backend", ["parallel", "query_major", "key_major"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_folded_rows_match_the_dense_oracle(monkeypatch, backend, case):
    q, k, v = _qkv()
    kw = dict(CASES[case])
    if kw.get("attn_mask") == "padding":
        kw["attn_mask"] = _padding(2, 300)
    elif kw.get("attn_mask") == "per head":
        kw["attn_mask"] = _padding(2, 300, heads=8)
    elif kw.get("attn_mask") == "additive":
        kw["attn_mask"] = torch.randn(2, 1, 1, 300, dtype=torch.float64)
    seen = _recorded_query_shapes(monkeypatch)
    O, lse = fa.flash_attention(q, k, v, backend=backend, return_lse=True, **kw)
    assert seen == [(2, 2, 4, 16)]  # folded: G = 4 rows per key/value head
    want, want_lse = dense_attention(q, k, v, enable_gqa=True, return_lse=True, **kw)
    torch.testing.assert_close(O, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-12)
    dO = torch.randn_like(O)
    grads = torch.autograd.grad(O, (q, k, v), dO)
    want_grads = torch.autograd.grad(want, (q, k, v), dO)
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-11, rtol=1e-11)


NOT_FOLDED = {
    "top-left causal": {"causal": True},  # the one row sees key 0 only; as rows they would see more
    "a window": {"window": (50, 0), "causal_align": "bottom_right"},
    "ALiBi": {"alibi_slopes": torch.rand(8, dtype=torch.float64)},
    # element 1's row (at key 122) sees its 123 keys; element 0's (at key 299) not its first 99
    "a window over seqlens_k": {
        "window": (200, 0),
        "causal_align": "bottom_right",
        "seqlens_k": torch.tensor([300, 123]),
    },
    "dropout": {"dropout_p": 0.2},
}


@pytest.mark.parametrize("case", sorted(NOT_FOLDED))
def test_calls_whose_row_depends_on_its_head_or_position_are_not_folded(monkeypatch, case):
    q, k, v = _qkv()
    seen = _recorded_query_shapes(monkeypatch)
    torch.manual_seed(0)
    O = fa.flash_attention(q, k, v, backend="query_major", **NOT_FOLDED[case])
    assert seen == [(2, 8, 1, 16)]
    if case != "dropout":
        torch.testing.assert_close(O, dense_attention(q, k, v, enable_gqa=True, **NOT_FOLDED[case]))


def test_several_query_rows_or_equal_heads_are_not_folded(monkeypatch):
    seen = _recorded_query_shapes(monkeypatch)
    q, k, v = _qkv(H_q=2)
    fa.flash_attention(q, k, v, backend="query_major")
    g = torch.Generator().manual_seed(1)
    fa.flash_attention(torch.randn(2, 8, 3, 16, generator=g), k.detach().float(), v.detach().float())
    assert seen == [(2, 2, 1, 16), (2, 8, 3, 16)]


def test_explain_counts_the_wide_tiles_of_a_decode_step():
    q, k, v = _qkv(N_k=3000)
    plan = fa.explain(q, k, v, attn_mask=_padding(2, 3000), enable_gqa=True)
    assert "tiles of 1024 x 2048" in plan.reason


@pytest.mark.parametrize("backend", ["auto", "parallel", "query_major", "key_major", "dense"])
@pytest.mark.parametrize("H_k, H_v", [(1, 4), (4, 1)])
@pytest.mark.parametrize("N_q", [1, 2])
def test_key_and_value_heads_that_broadcast_match_torch(backend, H_k, H_v, N_q):
    """One of key and value has a single head that broadcasts over the other's (torch's rule): the folded
    decode rows must take the key/value head count after broadcasting, not ``k``'s alone."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, N_q, 8, generator=g)
    k, v = torch.randn(1, H_k, 6, 8, generator=g), torch.randn(1, H_v, 6, 8, generator=g)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    if backend == "auto":
        got = fa.scaled_dot_product_attention(q, k, v)
    else:
        got = fa.flash_attention(q, k, v, enable_gqa=False, backend=backend)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
