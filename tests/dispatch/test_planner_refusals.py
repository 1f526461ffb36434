"""A backend named explicitly that cannot run a call is refused the same way by every public function, from
the one planner: a ``NotImplementedError`` (torch's convention for an unsupported case) that is also an
``AttentionValueError`` (the ``backend`` argument cannot be honoured), naming the backend and the reason."""

from __future__ import annotations

import pytest
import torch

import flashattn_teach as fa
from flashattn_teach.errors import BackendUnavailableError

# float64: a dtype the Triton kernels never take, on any device and under the interpreter too
q = torch.randn(1, 2, 3, 8, dtype=torch.float64)
packed = torch.randn(5, 2, 8, dtype=torch.float64)
cu = torch.tensor([0, 2, 5])
cache = torch.zeros(1, 2, 6, 8, dtype=torch.float64)

CALLS = {
    "flash_attention": lambda: fa.flash_attention(q, q, q, backend="triton"),
    "flash_attention_varlen": lambda: fa.flash_attention_varlen(packed, packed, packed, cu, cu, 3, 3, backend="triton"),
    "flash_attention_with_kvcache": lambda: fa.flash_attention_with_kvcache(
        q[:, :, :1], cache, cache, cache_seqlens=4, backend="triton"
    ),
    "explain": lambda: fa.explain(q, q, q, backend="triton"),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_named_backend_that_cannot_run_the_call_is_refused_with_the_reason(name):
    with pytest.raises(BackendUnavailableError, match=r"backend='triton' cannot run this (decode )?call: .*float64"):
        CALLS[name]()


def test_the_refusal_is_both_not_implemented_and_a_bad_value():
    assert issubclass(BackendUnavailableError, NotImplementedError)
    assert issubclass(BackendUnavailableError, fa.AttentionValueError)
    assert issubclass(BackendUnavailableError, RuntimeError)  # as torch raises for bad input


def test_a_refused_decode_call_writes_nothing():
    k_cache, v_cache = cache.clone(), cache.clone()
    new = torch.ones(1, 2, 1, 8, dtype=torch.float64)
    with pytest.raises(BackendUnavailableError):
        fa.flash_attention_with_kvcache(q[:, :, :1], k_cache, v_cache, new, new, cache_seqlens=4, backend="triton")
    assert not k_cache.any() and not v_cache.any()
