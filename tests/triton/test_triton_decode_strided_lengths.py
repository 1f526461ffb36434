"""The decode kernel reads ``cache_seqlens[b]`` and ``cache_leftpad[b]`` by the batch index alone: lengths
given as strided views (a slice of a longer tensor) must reach it back to back, or the kernel reads other
elements' values (it did: the output of a step with ``cache_seqlens[::2]`` was off by 1.2)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402

import flashattn_teach as fa  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs CPU tensors")
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_strided_lengths_and_padding_reach_the_kernel_as_their_values(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 1, 64, generator=g).half()
    k_cache, v_cache = (torch.randn(2, 1, 32, 64, generator=g).half() for _ in range(2))
    seqlens = torch.tensor([5, 99, 20, 99], dtype=dtype)[::2]  # [5, 20], stride 2
    leftpad = torch.tensor([2, 31, 7, 31], dtype=dtype)[::2]  # [2, 7], stride 2
    kwargs = dict(cache_seqlens=seqlens, cache_leftpad=leftpad)
    O = fa.flash_attention_with_kvcache(q, k_cache, v_cache, backend="triton", **kwargs)
    O_ref = fa.flash_attention_with_kvcache(q.double(), k_cache.double(), v_cache.double(), backend="dense", **kwargs)
    torch.testing.assert_close(O.double(), O_ref, atol=2e-3, rtol=2e-3)
    # negative control: the elements the strided views skip over would give another answer
    wrong = dict(cache_seqlens=torch.tensor([5, 99], dtype=dtype).clamp(max=32), cache_leftpad=leftpad.contiguous())
    O_wrong = fa.flash_attention_with_kvcache(q.double(), k_cache.double(), v_cache.double(), backend="dense", **wrong)
    assert (O.double() - O_wrong).abs().max() > 0.1
