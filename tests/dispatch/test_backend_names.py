"""The query-major reference is the backend ``"query_major"``; its old name ``"online"`` still runs it, with a
``DeprecationWarning`` that names the new one."""

from __future__ import annotations

import pytest
import torch

import flashattn_teach as fa
from flashattn_teach.dispatch import BACKENDS
from flashattn_teach.errors import AttentionValueError


def _qkv():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 2, 70, 8, generator=g, dtype=torch.float64) for _ in range(3))


def test_online_is_accepted_with_a_warning_naming_query_major():
    q, k, v = _qkv()
    with pytest.warns(DeprecationWarning, match="use 'query_major'") as record:
        O = fa.flash_attention(q, k, v, causal=True, backend="online")
    assert record[0].filename == __file__  # points at the caller's line
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(O, ref, atol=1e-12, rtol=0)


def test_explain_names_the_new_backend_for_the_old_name():
    q, k, v = _qkv()
    with pytest.warns(DeprecationWarning):
        p = fa.explain(q, k, v, backend="online")
    assert p.backend == "query_major" and str(p).startswith("query_major: ")


def test_an_unknown_backend_lists_query_major_not_online():
    q, k, v = _qkv()
    assert "query_major" in BACKENDS and "online" not in BACKENDS
    with pytest.raises(AttentionValueError, match="query_major") as err:
        fa.flash_attention(q, k, v, backend="onlin")
    assert "'online'" not in str(err.value)


def test_a_decode_step_takes_the_old_name_too():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 1, 8, generator=g, dtype=torch.float64)
    kc, vc = (torch.randn(1, 2, 20, 8, generator=g, dtype=torch.float64) for _ in range(2))
    with pytest.warns(DeprecationWarning, match="query_major"):
        O = fa.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=20, backend="online")
    ref = torch.nn.functional.scaled_dot_product_attention(q, kc, vc)
    torch.testing.assert_close(O, ref, atol=1e-12, rtol=0)
