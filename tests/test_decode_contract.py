"""The KV-cache call keeps the library's contracts (issue #21): one backend table for every public
function, flash-attn's ``causal=False`` default, autocast as ``flash_attention`` follows it, and a call
that raises writes nothing into the caches."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import flashattn_teach as fa

B, H_Q, H_KV, N_MAX, D = 2, 4, 2, 16, 8


def randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def step(seed=0, dtype=torch.float32, N_new=1):
    """``q, k_cache, v_cache, k, v`` of one decode step, as keyword arguments."""
    return {
        "q": randn(B, H_Q, N_new, D, seed=seed, dtype=dtype),
        "k_cache": randn(B, H_KV, N_MAX, D, seed=seed + 1, dtype=dtype),
        "v_cache": randn(B, H_KV, N_MAX, D, seed=seed + 2, dtype=dtype),
        "k": randn(B, H_KV, N_new, D, seed=seed + 3, dtype=dtype),
        "v": randn(B, H_KV, N_new, D, seed=seed + 4, dtype=dtype),
    }


# ------------------------------------------------------------------------------- backend names


def _kvcache(backend):
    return fa.flash_attention_with_kvcache(**step(), cache_seqlens=torch.tensor([3, 7]), backend=backend)


def _explain_kvcache(backend):
    return fa.explain_with_kvcache(**step(), cache_seqlens=3, backend=backend)


def _attention(backend):
    q = randn(1, 2, 5, D, seed=0)
    return fa.flash_attention(q, q, q, backend=backend)


def _varlen(backend):
    q = randn(7, 2, D, seed=0)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    return fa.flash_attention_varlen(q, q, q, cu, cu, 4, 4, backend=backend)


PUBLIC = {"flash_attention": _attention, "varlen": _varlen, "kvcache": _kvcache, "explain_kvcache": _explain_kvcache}


@pytest.mark.parametrize("call", PUBLIC)
def test_every_public_function_takes_the_deprecated_spelling_with_one_warning(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = PUBLIC[call]("keymajor")
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert [str(w.message) for w in deprecations] == ["backend='keymajor' is deprecated; use 'key_major'"]
    assert deprecations[0].filename == __file__  # the caller's line, not one inside the package
    new = PUBLIC[call]("key_major")
    if isinstance(new, torch.Tensor):
        assert torch.equal(old, new)
    else:
        assert old == new


@pytest.mark.parametrize("call", PUBLIC)
def test_every_public_function_refuses_an_unknown_backend_in_the_same_words(call):
    with pytest.raises(fa.AttentionValueError) as info:
        PUBLIC[call]("fast")
    assert str(info.value) == f"backend must be one of {fa.BACKENDS}, got 'fast'"


# ------------------------------------------------------------------------------- causal default


@pytest.mark.parametrize("function", [fa.flash_attention_with_kvcache, fa.explain_with_kvcache])
def test_causal_is_off_by_default_as_in_flash_attn(function):
    assert inspect.signature(function).parameters["causal"].default is False


def test_several_new_queries_see_every_valid_key_unless_causal():
    def run(**causal):
        args = step(N_new=3)
        return fa.flash_attention_with_kvcache(**args, cache_seqlens=torch.tensor([2, 9]), **causal)

    assert torch.equal(run(), run(causal=False))
    assert not torch.allclose(run(), run(causal=True))
