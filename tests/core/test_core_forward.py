"""core/dense.py and core/loops.py against torch's scaled_dot_product_attention in float64 and each other."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from flashattn_teach.core import dense_attention, key_major_attention, query_major_attention
from flashattn_teach.errors import AttentionTypeError, AttentionValueError

LOOPS = [query_major_attention, key_major_attention]
F64 = torch.float64


def inputs(N_q: int, N_k: int, D: int = 16, D_v: int = 8, seed: int = 0, gain: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, N_q, D, generator=g, dtype=F64) * gain
    k = torch.randn(2, 3, N_k, D, generator=g, dtype=F64) * gain
    v = torch.randn(2, 3, N_k, D_v, generator=g, dtype=F64)
    return q, k, v


def sdpa_lse(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float | None = None) -> torch.Tensor:
    """log-sum-exp of the scores, built from torch's own ops (SDPA does not return it)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    S = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if causal:
        S = S.masked_fill(torch.ones(S.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.logsumexp(S, dim=-1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("N_q", "N_k"), [(33, 33), (17, 45), (45, 17), (1, 64)])
def test_dense_matches_torch_sdpa_in_float64(causal: bool, N_q: int, N_k: int) -> None:
    q, k, v = inputs(N_q, N_k)
    O, lse = dense_attention(q, k, v, causal=causal, scale=0.3)
    assert O.dtype == lse.dtype == F64
    torch.testing.assert_close(O, F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3))
    torch.testing.assert_close(lse, sdpa_lse(q, k, causal, 0.3))


@given(
    N_q=st.integers(1, 90),
    N_k=st.integers(1, 90),
    block_m=st.integers(1, 40),
    block_n=st.integers(1, 40),
    causal=st.booleans(),
    loop=st.sampled_from(LOOPS),
)
def test_loops_match_dense_and_sdpa_for_any_tiling(N_q, N_k, block_m, block_n, causal, loop) -> None:
    q, k, v = inputs(N_q, N_k, seed=N_q * 100 + N_k)
    O, lse = loop(q, k, v, causal=causal, block_m=block_m, block_n=block_n)
    O_ref, lse_ref = dense_attention(q, k, v, causal=causal)
    torch.testing.assert_close(O, O_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(O, F.scaled_dot_product_attention(q, k, v, is_causal=causal))


@pytest.mark.parametrize("loop", [dense_attention, *LOOPS])
@pytest.mark.parametrize("causal", [False, True])
def test_logits_near_1e3_give_no_nan(loop, causal: bool) -> None:
    q, k, v = inputs(50, 70, gain=20.0)
    S = torch.einsum("bhid,bhjd->bhij", q, k) * 0.25
    assert S.abs().max() > 1e3  # the case the test is about
    O, lse = loop(q, k, v, causal=causal)
    assert not O.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(O, F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    torch.testing.assert_close(lse, sdpa_lse(q, k, causal))


@pytest.mark.parametrize("loop", [dense_attention, *LOOPS])
def test_rows_with_no_key_give_zero_and_minus_inf(loop) -> None:
    q, k, v = inputs(5, 0)
    O, lse = loop(q, k, v, causal=True)
    assert O.shape == (2, 3, 5, 8) and (O == 0).all()
    assert torch.isneginf(lse).all()


def test_float32_stays_float32_and_near_float64() -> None:
    q, k, v = inputs(40, 40)
    O, lse = query_major_attention(q.float(), k.float(), v.float(), causal=True, block_m=16, block_n=16)
    assert O.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(O.double(), dense_attention(q, k, v, causal=True)[0], rtol=1e-5, atol=1e-5)


def test_bad_inputs_name_the_argument_and_the_fix() -> None:
    q, k, v = inputs(4, 4)
    with pytest.raises(AttentionValueError, match="q must be 4-D"):
        dense_attention(q[0], k, v)
    with pytest.raises(AttentionValueError, match="no GQA"):
        query_major_attention(q, k[:, :1], v[:, :1])
    with pytest.raises(AttentionTypeError, match="cast them"):
        key_major_attention(q, k.float(), v)
    with pytest.raises(AttentionValueError, match="block sizes must be positive"):
        query_major_attention(q, k, v, block_m=0)
