"""The dropout generator: Philox4x32-10 as published, the same keep mask in torch and in a Triton kernel,
and the keep rate it promises."""

from __future__ import annotations

import math

import pytest
import torch

from flashattn_teach import dropout as dp

# Known-answer vectors for Philox4x32-10 from Random123's kat_vectors (counter words, key words -> output).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("counter", "key", "expected"), KAT)
def test_philox_matches_published_vectors(counter, key, expected):
    words = [torch.tensor([c], dtype=torch.int64) for c in counter]
    out = dp.philox4x32(*words, *key)
    assert [int(w) for w in out] == list(expected)


def test_mulhilo_is_the_exact_product():
    x = torch.tensor([0, 1, 0xFFFF, 0x10000, 0x12345678, 0xFFFFFFFF], dtype=torch.int64)
    for a in (dp.PHILOX_ROUND_A, dp.PHILOX_ROUND_B, 0xFFFFFFFF):
        hi, lo = dp._mulhilo(a, x)
        for h, l_, xi in zip(hi.tolist(), lo.tolist(), x.tolist(), strict=True):
            assert (h << 32) | l_ == a * xi


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_one_minus_p(p):
    key = dp.DropoutKey(p=p, seed=1234567891011, offset=0)
    n = 200_000
    keep = dp.keep_mask(key, dp.counters(key, 3, torch.zeros(1, dtype=torch.int64), torch.arange(n), 1, n))
    rate = keep.double().mean().item()
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)  # five standard errors


def test_draw_follows_torch_manual_seed():
    torch.manual_seed(7)
    a = dp.draw(0.3)
    torch.manual_seed(7)
    b = dp.draw(0.3)
    c = dp.draw(0.3)
    assert a == b and a != c
    assert dp.draw(0.0) == dp.DropoutKey()


def test_drop_is_unbiased_and_scales_survivors():
    key = dp.DropoutKey(p=0.25, seed=99, offset=5)
    P = torch.rand(64, 512, dtype=torch.float64)
    rows, cols = torch.arange(64)[:, None], torch.arange(512)[None, :]
    out = dp.drop(P, key, 0, rows, cols, 64, 512)
    kept = out != 0
    torch.testing.assert_close(out[kept], P[kept] / 0.75)
    assert abs(kept.double().mean().item() - 0.75) < 0.01
    assert torch.equal(dp.drop(P, dp.DropoutKey(), 0, rows, cols, 64, 512), P)
    assert torch.count_nonzero(dp.drop(P, dp.DropoutKey(p=1.0, seed=1), 0, rows, cols, 64, 512)) == 0


def test_offset_shifts_the_stream():
    key, shifted = dp.DropoutKey(p=0.5, seed=3, offset=0), dp.DropoutKey(p=0.5, seed=3, offset=10)
    cols = torch.arange(100)
    a = dp.keep_mask(key, dp.counters(key, 0, torch.zeros(1), cols, 1, 100))
    b = dp.keep_mask(shifted, dp.counters(shifted, 0, torch.zeros(1), cols, 1, 100))
    assert torch.equal(a[10:], b[:90]) and not torch.equal(a, b)


def test_dropout_is_refused_while_a_cuda_graph_is_captured(monkeypatch):
    import flashattn_teach as fa

    q = torch.randn(1, 2, 8, 16)
    fa.flash_attention(q, q, q, dropout_p=0.1, backend="query_major")  # the control: not capturing
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    fa.flash_attention(q, q, q, backend="query_major")  # no dropout, nothing drawn: allowed
    with pytest.raises(fa.AttentionValueError, match=r"dropout_p=0\.1 while a CUDA graph is being captured"):
        fa.flash_attention(q, q, q, dropout_p=0.1, backend="query_major")
