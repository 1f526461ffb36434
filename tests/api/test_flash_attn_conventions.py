"""flash-attn's conventions where this library takes flash-attn's names: ``softcap=0.0`` (flash-attn's default
argument) means no softcap, on every function that takes flash-attn's options."""

from __future__ import annotations

import pytest
import torch

import flashattn_teach as fa

BACKENDS = ["parallel", "query_major", "key_major", "dense"]


def _qkv(seed=0, shape=(2, 4, 7, 8)):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g, dtype=torch.float64) * 3 for _ in range(3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_zero_is_no_softcap(backend):
    q, k, v = _qkv()
    expected = fa.flash_attention(q, k, v, causal=True, backend=backend)
    got = fa.flash_attention(q, k, v, causal=True, softcap=0.0, backend=backend)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    # negative control: a real cap changes these scaled-up scores
    capped = fa.flash_attention(q, k, v, causal=True, softcap=1.0, backend=backend)
    assert (capped - expected).abs().max() > 1e-3


def test_softcap_zero_is_no_softcap_on_packed_sequences():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(9, 2, 8, generator=g, dtype=torch.float64) * 3 for _ in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    args = (q, k, v, cu, cu, 5, 5)
    expected = fa.flash_attention_varlen(*args, causal=True)
    torch.testing.assert_close(fa.flash_attention_varlen(*args, causal=True, softcap=0.0), expected, atol=0, rtol=0)


@pytest.mark.parametrize("softcap", [-1.0, float("nan"), float("inf")])
def test_a_negative_or_infinite_softcap_is_still_refused(softcap):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="softcap must be a finite number > 0 \\(or 0 or None for no cap\\)"):
        fa.flash_attention(q, k, v, softcap=softcap)
