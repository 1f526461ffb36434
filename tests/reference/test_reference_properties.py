"""Property tests: every CPU path equals the float64 dense oracle (forward)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashattn_teach.reference import dense_attention, key_major_attention, online_attention

from attention_strategies import problems

TILED = [pytest.param(online_attention, id="query_major"), pytest.param(key_major_attention, id="key_major")]


def assert_lse_equal(lse, ref, atol):
    # -inf (a row that sees no key) must match exactly; finite values to tolerance.
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref))
    finite = ~torch.isneginf(ref)
    torch.testing.assert_close(lse[finite], ref[finite], atol=atol, rtol=0)


@pytest.mark.parametrize("attention", TILED)
@given(p=problems(torch.float64))
def test_tiled_matches_dense_for_any_tiling_float64(attention, p):
    O_ref, lse_ref = dense_attention(p.q, p.k, p.v, return_lse=True, **p.kwargs)
    O, lse = attention(p.q, p.k, p.v, return_lse=True, **p.kwargs, **p.tiles)
    assert O.dtype == torch.float64 and O.shape == O_ref.shape
    torch.testing.assert_close(O, O_ref, atol=1e-12, rtol=0)
    assert_lse_equal(lse, lse_ref, 1e-12)


@pytest.mark.parametrize("attention", TILED)
@given(p=problems(torch.float32))
def test_tiled_matches_float64_oracle_for_any_tiling_float32(attention, p):
    O_ref, lse_ref = dense_attention(p.q.double(), p.k.double(), p.v.double(), return_lse=True, **p.kwargs)
    O, lse = attention(p.q, p.k, p.v, return_lse=True, **p.kwargs, **p.tiles)
    assert O.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(O.double(), O_ref, atol=2e-5, rtol=0)
    assert_lse_equal(lse.double(), lse_ref, 2e-5)


@pytest.mark.parametrize("attention", TILED)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tiled_low_precision_inputs_accumulate_in_float32(attention, dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 29, 8, generator=g) for _ in range(3))
    O_ref = dense_attention(q.double(), k.double(), v.double(), causal=True)
    O = attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True, block_m=4, block_n=8)
    assert O.dtype == dtype
    # The error is dominated by rounding the inputs and the output to `dtype`, not by the tiling.
    tol = 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(O.double(), O_ref, atol=tol, rtol=0)


@pytest.mark.parametrize("attention", [*TILED, pytest.param(dense_attention, id="dense")])
@given(p=problems(torch.float64), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_large_logits_stay_finite_and_exact(attention, p, dtype):
    """Scores stretched to |S| = 1e4: exp(S) overflows, exp(S - m) does not (the running-max correction)."""
    S = (p.q @ p.k.repeat_interleave(p.q.shape[1] // p.k.shape[1], dim=1).mT) / p.q.shape[-1] ** 0.5
    c = (1e4 / S.abs().max().clamp_min(1e-3)).sqrt()
    q, k = p.q * c, p.k * c
    O_ref, lse_ref = dense_attention(q, k, p.v, return_lse=True, **p.kwargs)
    kw = {} if attention is dense_attention else p.tiles
    O, lse = attention(q.to(dtype), k.to(dtype), p.v.to(dtype), return_lse=True, **p.kwargs, **kw)
    assert torch.isfinite(O).all()
    assert not torch.isnan(lse).any()
    # float32 rounds a score of 1e4 by ~1e-3, which moves softmax weights by about as much.
    atol = 1e-9 if dtype == torch.float64 else 5e-2
    torch.testing.assert_close(O.double(), O_ref, atol=atol, rtol=0)
    assert_lse_equal(lse.double(), lse_ref, atol * 1e4)


@pytest.mark.parametrize("attention", TILED)
@given(p=problems(torch.float64), shift=st.floats(-1e3, 1e3))
def test_adding_a_constant_to_a_row_of_scores_changes_nothing(attention, p, shift):
    """softmax(S_i + c) = softmax(S_i): append a feature that adds c_i to every score of row i."""
    scale = p.q.shape[-1] ** -0.5
    c = torch.linspace(-1, 1, p.q.shape[-2], dtype=p.q.dtype) * shift  # one constant per query row
    q_aug = torch.cat([p.q, (c / scale).expand(*p.q.shape[:-1]).unsqueeze(-1)], dim=-1)
    k_aug = torch.cat([p.k, torch.ones(*p.k.shape[:-1], 1, dtype=p.k.dtype)], dim=-1)
    O, lse = attention(p.q, p.k, p.v, scale=scale, return_lse=True, **p.kwargs, **p.tiles)
    O_aug, lse_aug = attention(q_aug, k_aug, p.v, scale=scale, return_lse=True, **p.kwargs, **p.tiles)
    torch.testing.assert_close(O_aug, O, atol=1e-9, rtol=0)
    assert_lse_equal(lse_aug, lse + c, 1e-9)


@pytest.mark.parametrize("attention", TILED)
@given(p=problems(torch.float64), data=st.data())
def test_permuting_keys_and_values_together_changes_nothing(attention, p, data):
    perm = torch.tensor(data.draw(st.permutations(range(p.k.shape[-2]))), dtype=torch.long)
    O, lse = attention(p.q, p.k, p.v, return_lse=True, enable_gqa=True, **p.tiles)
    O_p, lse_p = attention(p.q, p.k[..., perm, :], p.v[..., perm, :], return_lse=True, enable_gqa=True, **p.tiles)
    torch.testing.assert_close(O_p, O, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse_p, lse, atol=1e-12, rtol=0)


@settings(max_examples=10)
@given(p=problems(torch.float64))
def test_query_major_and_key_major_agree(p):
    a = online_attention(p.q, p.k, p.v, **p.kwargs, **p.tiles)
    b = key_major_attention(p.q, p.k, p.v, **p.kwargs, **p.tiles)
    torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
