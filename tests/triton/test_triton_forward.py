"""The fused forward kernel equals the float64 dense oracle for any shape the API accepts."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _triton_cases import DEVICE, DTYPES, LONG, REL_TOL, WIDE_GQA, Case, assert_close_scaled, cases
from hypothesis import example, given, settings

from flashattn_teach.errors import AttentionValueError
from flashattn_teach.reference import dense_attention
from flashattn_teach.triton import AttentionConfig, tma, triton_attention
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
@example(c=WIDE_GQA)
@example(c=LONG)
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


def _with_forward(config: AttentionConfig, **changes: object) -> AttentionConfig:
    return dataclasses.replace(config, forward=dataclasses.replace(config.forward, **changes))


TMA_CONFIG = _with_forward(AttentionConfig.uniform(32, 16), tma=True)


@settings(max_examples=30)
@given(c=cases())
@example(c=WIDE_GQA)
@example(c=LONG)
def test_forward_by_tma_descriptors_matches_dense_for_any_shape(c: Case) -> None:
    # the interpreter runs tensor descriptors too, with the copy engine's zero fill past N and D
    _, k, v = c.tensors()
    assert tma.use_tma(TMA_CONFIG.forward, k, v)  # rows of 16 to 64 fp16/fp32 lanes: 16-byte multiples
    check_forward(dataclasses.replace(c, config=_with_forward(c.config, tma=True)))


@pytest.mark.parametrize("by_tma", [False, True])
def test_bnhd_views_with_gqa_match_dense_through_either_load_path(by_tma: bool) -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 41, 4, 40, generator=g).to(DEVICE).transpose(1, 2)  # (B, H_q, N_q, D) view of (B, N, H, D)
    k, v = (torch.randn(2, 29, 2, 40, generator=g).to(DEVICE).transpose(1, 2) for _ in range(2))
    assert tma.tma_reason(k) is None and not k.is_contiguous()
    config = _with_forward(AttentionConfig.uniform(32, 16), tma=by_tma)
    assert tma.use_tma(config.forward, k, v) == by_tma
    O = triton_attention(q, k, v, causal=True, causal_align="bottom_right", enable_gqa=True, config=config)
    ref = dense_attention(
        *(t.double().cpu() for t in (q, k, v)), causal=True, causal_align="bottom_right", enable_gqa=True
    )
    assert_close_scaled(O, ref, REL_TOL[torch.float32], "O")


def test_tma_falls_back_to_pointers_when_strides_are_not_16_byte_multiples() -> None:
    # D = 17 in fp16: rows are 34 bytes apart, which a tensor descriptor cannot describe
    q, k, v = (torch.randn(1, 2, n, 17).to(DEVICE, torch.float16) for n in (21, 35, 35))
    assert tma.tma_reason(k) == f"strides {k.stride()} are not multiples of 16 bytes"
    assert not tma.use_tma(TMA_CONFIG.forward, k, v)
    O = triton_attention(q, k, v, causal=True, config=TMA_CONFIG)
    assert_close_scaled(O, dense_attention(q.double(), k.double(), v.double(), causal=True), 5e-3, "O")


@pytest.mark.parametrize("by_tma", [False, True])
@pytest.mark.parametrize("scale", [-0.7, 0.0, 2.5])
def test_any_sign_of_scale_matches_dense(scale: float, by_tma: bool) -> None:
    # the kernel takes the row max of raw scores: a negative scale must flip it (the launcher negates Q),
    # and scale = 0 gives uniform weights over the visible keys: a masked score is -inf, and -inf * 0 must
    # not reach P as NaN
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g).to(DEVICE) for n in (37, 37, 37))
    config = _with_forward(AttentionConfig.uniform(16, 16), tma=by_tma)
    O, lse = triton_attention(q, k, v, causal=True, scale=scale, return_lse=True, config=config)
    ref_O, ref_lse = dense_attention(
        q.double().cpu(), k.double().cpu(), v.double().cpu(), causal=True, scale=scale, return_lse=True
    )
    assert_close_scaled(O, ref_O, REL_TOL[torch.float32], "O")
    assert_close_scaled(lse, ref_lse, REL_TOL[torch.float32], "lse")


def test_a_head_longer_than_2_to_the_31_elements_is_addressed_in_64_bit() -> None:
    # K rows 2^24 elements apart: row 128 starts at element 2^31, past int32. The storage is 4 GiB of
    # virtual memory of which only the rows written are touched. In a subprocess: a wrapped 32-bit
    # offset reads far outside the tensor, and the interpreter then dies with a segmentation fault.
    code = textwrap.dedent(
        """
        import torch
        from flashattn_teach.reference import dense_attention
        from flashattn_teach.triton import AttentionConfig, triton_attention
        S, N = 2**24, 130
        store = torch.empty((N - 1) * S + 32, dtype=torch.float16)
        rows = torch.randn(N, 32, generator=torch.Generator().manual_seed(5)).half()
        for r in range(N):
            store[r * S : r * S + 32] = rows[r]
        k = store.as_strided((1, 1, N, 32), (0, 0, S, 1))
        q, v = torch.randn(1, 1, 5, 32).half(), torch.randn(1, 1, N, 32).half()
        O = triton_attention(q, k, v, config=AttentionConfig.uniform(16, 16))
        ref = dense_attention(q.double(), rows.double().view(1, 1, N, 32), v.double())
        print((O.double() - ref).abs().max().item())
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert float(done.stdout.split()[-1]) < 5e-3


def test_a_tile_spanning_2_to_the_31_elements_is_refused_by_name() -> None:
    store = torch.empty(2**28 + 2, dtype=torch.float16)  # 512 MiB of virtual memory, untouched
    k = store.as_strided((1, 1, 2, 2), (0, 0, 2**28, 1))  # rows 2^28 apart: one 16-row tile spans 15 x 2^28
    q = torch.randn(1, 1, 4, 2, dtype=torch.float16)
    with pytest.raises(
        AttentionValueError,
        match=r"k \(1, 1, 2, 2\) with strides .*: a forward tile of 16 rows spans \d+ elements, beyond 32-bit",
    ):
        triton_attention(q, k, k, config=AttentionConfig.uniform(16, 16))


def test_empty_and_broadcast_keys_take_the_pointer_path() -> None:
    # a descriptor needs a positive size in every dimension; a broadcast batch has stride 0
    q = torch.randn(2, 1, 3, 16).to(DEVICE)
    empty = torch.randn(2, 1, 0, 16).to(DEVICE)
    assert tma.tma_reason(empty) == "it is empty (a descriptor needs a positive size in every dimension)"
    O, lse = triton_attention(q, empty, empty, return_lse=True, config=TMA_CONFIG)
    assert (O == 0).all() and torch.isneginf(lse).all()
    k = torch.randn(1, 1, 19, 16).to(DEVICE)
    broadcast = k.expand(2, 1, 19, 16)
    assert "broadcast" in str(tma.tma_reason(broadcast))
    assert_close_scaled(
        triton_attention(q, k, k, config=TMA_CONFIG), dense_attention(q.double(), k.double(), k.double()), 2e-4, "O"
    )
