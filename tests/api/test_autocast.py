"""Under torch.autocast the result has the dtype torch's SDPA gives, while the arithmetic stays float32.

torch casts SDPA's inputs to the autocast dtype (float64 excepted). The library does the same cast, then
computes scores, running statistics and the accumulator in float32: the ``lse`` it returns is float32 and
as accurate as a float32 computation from the cast inputs, which a bfloat16 accumulator could not be.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashattn_teach as fa
from flashattn_teach.reference import dense_attention

CPU_BACKENDS = ["auto", "parallel", "query_major", "key_major", "dense"]


def r(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_result_dtype_is_torchs(autocast_dtype, input_dtype):
    q, k, v = (r(1, 2, 9, 8, seed=s, dtype=input_dtype) for s in (1, 2, 3))
    with torch.autocast("cpu", dtype=autocast_dtype):
        expected = F.scaled_dot_product_attention(q, k, v)
        got = fa.scaled_dot_product_attention(q, k, v)
        got_flash = fa.flash_attention(q, k, v)
        got_dense = dense_attention(q, k, v)
    assert got.dtype == got_flash.dtype == got_dense.dtype == expected.dtype


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_arithmetic_stays_float32(backend):
    q, k, v = (r(2, 3, 300, 64, seed=s) * 3 for s in (1, 2, 3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        O, lse = fa.flash_attention(q, k, v, backend=backend, return_lse=True)
    assert O.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # The oracle: float64 arithmetic on the inputs autocast hands over (rounded to bfloat16).
    O_ref, lse_ref = dense_attention(*(t.bfloat16().double() for t in (q, k, v)), return_lse=True)
    # float32 arithmetic keeps lse within ~1e-5 of it; bfloat16 scores or sums would be off by ~1e-2.
    assert (lse.double() - lse_ref).abs().max() < 1e-4
    # O: one rounding to bfloat16 at the end (half an ulp: at most 2^-8 relative) on top of float32 arithmetic.
    assert ((O.double() - O_ref).abs() <= O_ref.abs() * 2**-8 + 1e-4).all()


def test_gradients_under_autocast_match_torch():
    q, k, v = (r(1, 2, 33, 16, seed=s).requires_grad_() for s in (1, 2, 3))
    qt, kt, vt = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fa.scaled_dot_product_attention(q, k, v, is_causal=True)
        expected = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        assert out.dtype == expected.dtype == torch.bfloat16
        out.float().square().sum().backward()
        expected.float().square().sum().backward()
    for a, b in zip((q, k, v), (qt, kt, vt), strict=True):
        assert a.grad.dtype == b.grad.dtype == torch.float32
        torch.testing.assert_close(a.grad, b.grad, atol=3e-2, rtol=3e-2)


def test_float32_mask_under_autocast():
    q, k, v = (r(1, 2, 5, 8, seed=s) for s in (1, 2, 3))
    mask = torch.zeros(5, 5)
    mask[:, 3:] = float("-inf")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
