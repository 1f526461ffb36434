"""The fused forward kernel equals the float64 dense oracle for any shape the API accepts."""

from __future__ import annotations

import pytest
import torch
from _triton_cases import DEVICE, DTYPES, REL_TOL, Case, assert_close_scaled, cases
from hypothesis import given, settings

from flashattn_teach.reference import dense_attention
from flashattn_teach.triton import AttentionConfig, triton_attention
from flashattn_teach.triton.configs import max_head_dim


def check_forward(c: Case) -> None:
    q, k, v = c.tensors()
    O, lse = triton_attention(
        q, k, v, causal=c.causal, causal_align=c.causal_align, enable_gqa=True, return_lse=True, config=c.config
    )
    ref_O, ref_lse = dense_attention(
        q.double().cpu(),
        k.double().cpu(),
        v.double().cpu(),
        causal=c.causal,
        causal_align=c.causal_align,
        enable_gqa=True,
        return_lse=True,
    )
    assert O.shape == (c.B, c.H_q, c.N_q, c.D_v) and O.dtype == c.dtype
    assert lse.shape == (c.B, c.H_q, c.N_q) and lse.dtype == torch.float32
    assert_close_scaled(O, ref_O, REL_TOL[c.dtype], "O")
    assert_close_scaled(lse, ref_lse, REL_TOL[torch.float32], "lse")


@settings(max_examples=80)
@given(c=cases())
def test_forward_matches_dense_for_any_shape(c: Case) -> None:
    check_forward(c)


@pytest.mark.parametrize(
    ("D", "dtype"),
    [(D, dt) for dt in DTYPES for D in (16, 40, 64, 80, 96, 128, 256) if D <= max_head_dim(dt, backward=False)],
)
def test_forward_matches_dense_for_every_head_dim(D: int, dtype: torch.dtype) -> None:
    check_forward(
        Case(
            B=1,
            H_kv=1,
            group=2,
            N_q=45,
            N_k=37,
            D=D,
            D_v=D,
            causal=True,
            causal_align="bottom_right",
            dtype=dtype,
            config=AttentionConfig.uniform(32, 16),
        )
    )


@pytest.mark.parametrize("causal_align", ["top_left", "bottom_right"])
def test_rows_that_see_no_key_give_zero_output_and_minus_inf_lse(causal_align: str) -> None:
    # bottom_right with N_q > N_k: the first N_q - N_k rows see nothing
    c = Case(
        B=1,
        H_kv=1,
        group=1,
        N_q=50,
        N_k=20,
        D=16,
        D_v=16,
        causal=True,
        causal_align=causal_align,
        dtype=torch.float32,
        config=AttentionConfig.uniform(16, 16),
    )
    q, k, v = c.tensors()
    O, lse = triton_attention(q, k, v, causal=True, causal_align=causal_align, return_lse=True, config=c.config)
    empty = 30 if causal_align == "bottom_right" else 0
    assert torch.isneginf(lse[..., :empty]).all() and torch.isfinite(lse[..., empty:]).all()
    assert (O[..., :empty, :] == 0).all()
    check_forward(c)


def test_strided_view_runs_without_a_copy() -> None:
    # (B, N, H, D) storage viewed as (B, H, N, D): the kernel reads the strides, the result is the same
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, n, 3, 32, generator=g).to(DEVICE) for n in (33, 47, 47))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    assert not qt.is_contiguous()
    config = AttentionConfig.uniform(32, 16)
    O = triton_attention(qt, kt, vt, causal=True, config=config)
    O_contig = triton_attention(qt.contiguous(), kt.contiguous(), vt.contiguous(), causal=True, config=config)
    assert torch.equal(O, O_contig)


def test_lower_ranks_and_broadcast_batch_match_dense() -> None:
    g = torch.Generator().manual_seed(2)
    config = AttentionConfig.uniform(16, 16)
    q2, k2, v2 = (torch.randn(n, 16, generator=g).to(DEVICE) for n in (19, 23, 23))
    assert_close_scaled(triton_attention(q2, k2, v2, config=config), dense_attention(q2, k2, v2), 2e-4, "2-D")
    q3 = torch.randn(2, 19, 16, generator=g).to(DEVICE)
    k4 = torch.randn(3, 1, 23, 16, generator=g).to(DEVICE)  # MQA (one key/value head) and a batch of 3
    out = triton_attention(q3, k4, k4, config=config)
    assert out.shape == (3, 2, 19, 16)
    assert_close_scaled(out, dense_attention(q3, k4, k4), 2e-4, "broadcast")
