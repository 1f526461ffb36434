"""The Triton backward kernels give the float64 oracle's gradients, deterministically, also under torch.func."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import pytest
import torch
from _triton_cases import DEVICE, EMPTY_ROWS, ON_GPU, REL_TOL, WIDE_GQA, Case, assert_close_scaled, cases
from hypothesis import example, given, settings

from flashattn_teach.errors import AttentionValueError
from flashattn_teach.reference import dense_attention
from flashattn_teach.triton import AttentionConfig, KernelConfig, launch, shipped_config, tma, triton_attention


def grads(c: Case, q, k, v, dO, dlse=None, triton: bool = True):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if triton:
        O, lse = triton_attention(
            q, k, v, causal=c.causal, causal_align=c.causal_align, enable_gqa=True, return_lse=True, config=c.config
        )
    else:
        O, lse = dense_attention(
            q, k, v, causal=c.causal, causal_align=c.causal_align, enable_gqa=True, return_lse=True
        )
    # a loss of O alone, of lse alone, or of both: autograd passes the function None for an unused output
    terms = []
    if dO is not None:
        terms.append((O * dO.to(O.dtype)).sum())
    if dlse is not None:
        terms.append((torch.where(torch.isneginf(lse), 0.0, lse) * dlse.to(lse.dtype)).sum())
    sum(terms).backward()
    # lse does not depend on v: the oracle leaves v.grad None where the kernels return zeros
    return tuple(torch.zeros_like(t) if t.grad is None else t.grad for t in (q, k, v))


def check_backward(c: Case, with_dO: bool = True, with_dlse: bool = False) -> None:
    q, k, v = c.tensors()
    g = torch.Generator().manual_seed(7)
    dO = torch.randn(c.B, c.H_q, c.N_q, c.D_v, generator=g).to(DEVICE, c.dtype)
    dlse = torch.randn(c.B, c.H_q, c.N_q, generator=g).to(DEVICE)
    dO, dlse = (dO if with_dO else None), (dlse if with_dlse else None)
    got = grads(c, q, k, v, dO, dlse)
    want = grads(
        c,
        q.double().cpu(),
        k.double().cpu(),
        v.double().cpu(),
        None if dO is None else dO.double().cpu(),
        None if dlse is None else dlse.double().cpu(),
        triton=False,
    )
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == c.dtype and a.shape == b.shape
        assert_close_scaled(a, b, 2 * REL_TOL[c.dtype], name)


@settings(max_examples=60)
@given(c=cases(max_n=64))
@example(c=WIDE_GQA)
@example(c=EMPTY_ROWS)
def test_backward_matches_dense_for_any_shape(c: Case) -> None:
    check_backward(c)


@pytest.mark.parametrize("D", [16, 40, 96, 200])
def test_backward_matches_dense_for_every_head_dim(D: int) -> None:
    check_backward(
        Case(
            B=1,
            H_kv=1,
            group=2,
            N_q=37,
            N_k=45,
            D=D,
            D_v=D,
            causal=True,
            causal_align="top_left",
            dtype=torch.float16,
            config=AttentionConfig.uniform(32, 16),
        )
    )


@pytest.mark.parametrize("with_dO", [True, False], ids=["O_and_lse", "lse_alone"])
@pytest.mark.parametrize("causal_align", ["top_left", "bottom_right"])
def test_gradient_through_lse_matches_dense(causal_align: str, with_dO: bool) -> None:
    check_backward(
        Case(
            B=1,
            H_kv=2,
            group=2,
            N_q=40,
            N_k=27,
            D=32,
            D_v=32,
            causal=True,
            causal_align=causal_align,
            dtype=torch.float32,
            config=AttentionConfig.uniform(16, 32),
        ),
        with_dO=with_dO,
        with_dlse=True,
    )


@pytest.mark.parametrize(
    ("H_kv", "group", "N_q", "N_k", "causal"),
    [(1, 4, 33, 33, False), (2, 3, 45, 38, True)],
    ids=["mqa_4_heads", "gqa_2x3_causal_ragged"],
)
def test_gqa_gradients_sum_over_the_query_heads_of_a_group(
    H_kv: int, group: int, N_q: int, N_k: int, causal: bool
) -> None:
    # dK/dV walks (query head, query block) pairs in one loop (with causal: the diagonal and full stages,
    # ragged N_q): against the same computation with K, V repeated per query head
    c = Case(1, H_kv, group, N_q, N_k, 16, 16, causal, "bottom_right", torch.float32, AttentionConfig.uniform(16, 16))
    q, k, v = c.tensors()
    dO = torch.randn(1, c.H_q, N_q, 16).to(DEVICE)
    dq, dk, dv = grads(c, q, k, v, dO)
    flat = Case(**{**c.__dict__, "H_kv": c.H_q, "group": 1})
    dq_r, dk_r, dv_r = grads(flat, q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), dO)
    assert dk.shape == k.shape
    assert_close_scaled(dq, dq_r, 1e-5, "dq")
    assert_close_scaled(dk, dk_r.unflatten(1, (H_kv, group)).sum(2), 1e-5, "dk")
    assert_close_scaled(dv, dv_r.unflatten(1, (H_kv, group)).sum(2), 1e-5, "dv")


def test_backward_is_bitwise_deterministic() -> None:
    c = Case(
        B=2,
        H_kv=1,
        group=2,
        N_q=49,
        N_k=70,
        D=32,
        D_v=32,
        causal=True,
        causal_align="bottom_right",
        dtype=torch.float16,
        config=AttentionConfig.uniform(32, 16),
    )
    q, k, v = c.tensors()
    dO = torch.randn(2, 2, 49, 32).to(DEVICE, torch.float16)
    # the one-kernel backward's atomic adds run in a fixed order in the interpreter; the deterministic
    # backward is checked in test_triton_backward_fused.py, and on a GPU in gpu_cases.py
    first, second = grads(c, q, k, v, dO), grads(c, q, k, v, dO)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_torch_func_vjp_matches_autograd_of_the_dense_oracle() -> None:
    # torch.func sees through the function's setup_context form; cotangents for both O and lse
    c = Case(
        B=1,
        H_kv=1,
        group=2,
        N_q=19,
        N_k=23,
        D=16,
        D_v=16,
        causal=True,
        causal_align="bottom_right",
        dtype=torch.float32,
        config=AttentionConfig.uniform(16, 16),
    )
    q, k, v = c.tensors()
    g = torch.Generator().manual_seed(3)
    dO, dlse = torch.randn(1, 2, 19, 16, generator=g).to(DEVICE), torch.randn(1, 2, 19, generator=g).to(DEVICE)

    def attention(q, k, v):
        return triton_attention(
            q, k, v, causal=True, causal_align=c.causal_align, enable_gqa=True, return_lse=True, config=c.config
        )

    (O, lse), vjp_fn = torch.func.vjp(attention, q, k, v)
    got = vjp_fn((dO, dlse))
    q64, k64, v64 = (t.double().cpu().requires_grad_() for t in (q, k, v))
    ref_O, ref_lse = dense_attention(
        q64, k64, v64, causal=True, causal_align=c.causal_align, enable_gqa=True, return_lse=True
    )
    want = torch.autograd.grad((ref_O, ref_lse), (q64, k64, v64), (dO.double().cpu(), dlse.double().cpu()))
    assert_close_scaled(O, ref_O.detach(), REL_TOL[c.dtype], "O")
    assert_close_scaled(lse, ref_lse.detach(), REL_TOL[torch.float32], "lse")
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert a.shape == b.shape
        assert_close_scaled(a, b, 2 * REL_TOL[c.dtype], name)


def test_the_preprocess_writes_delta_and_lse_in_log2_units_with_inf_for_rows_that_saw_no_key() -> None:
    from flashattn_teach.triton.kernels.backward import attn_bwd_preprocess
    from flashattn_teach.triton.kernels.records import RowStats, strided

    B, H, N, D = 2, 3, 37, 24  # N past a block of 16, D below its padded 32: ragged rows and lanes
    g = torch.Generator().manual_seed(3)
    o, do = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    lse = torch.randn(B, H, N, generator=g, dtype=torch.float64)
    lse[0, 1, :5] = float("-inf")  # rows that saw no key
    delta, lse2 = (torch.full((B, H, N), float("nan"), dtype=torch.float32, device=DEVICE) for _ in range(2))
    o32, do32 = (t.to(DEVICE, torch.float32).transpose(1, 2).contiguous().transpose(1, 2) for t in (o, do))
    row_stats = RowStats(lse2, delta, stride_h=N)  # written
    attn_bwd_preprocess[(3 * B * H,)](
        strided(o32), strided(do32), lse.to(DEVICE, torch.float32), row_stats, H_q=H, N_q=N,
        HEAD_DIM_V=D, BLOCK_DV=32, BLOCK_M=16,
    )  # fmt: skip
    torch.testing.assert_close(delta.double().cpu(), (o * do).sum(-1), atol=1e-5, rtol=1e-5)
    want = torch.where(lse == float("-inf"), float("inf"), lse * math.log2(math.e))
    torch.testing.assert_close(lse2.double().cpu(), want, atol=1e-5, rtol=1e-6)
    assert torch.isposinf(lse2[0, 1, :5]).all() and torch.isfinite(lse2[0, 1, 5:]).all()


def test_a_config_without_backward_kernels_is_refused_when_gradients_are_asked() -> None:
    q, k, v = (torch.randn(1, 1, 20, 16).to(DEVICE).requires_grad_() for _ in range(3))
    forward_only = AttentionConfig(forward=KernelConfig(16, 16, 4, 1), backward_dkdv=None, backward_dq=None)
    with pytest.raises(AttentionValueError, match="backward_dkdv=None"):  # at the call, not at backward()
        triton_attention(q, k, v, config=forward_only)
    with torch.no_grad():  # no gradient asked for: the forward-only configuration runs
        O = triton_attention(q, k, v, config=forward_only)
    torch.testing.assert_close(O, dense_attention(q, k, v).detach(), atol=1e-4, rtol=1e-4)


def test_one_dimensional_grid_covers_every_batch_head_and_block() -> None:
    # n_blocks * B * H programs, the block index fastest: an error in the (block, batch, head) decoding
    # writes some gradient block twice and leaves another empty
    check_backward(
        Case(
            B=2,
            H_kv=3,
            group=1,
            N_q=50,
            N_k=35,
            D=16,
            D_v=16,
            causal=False,
            causal_align="top_left",
            dtype=torch.float32,
            config=AttentionConfig.uniform(16, 16),
        )
    )


def _lazy_rows(n_rows: int, stride_n: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """A ``(1, 1, n_rows, width)`` view whose rows lie ``stride_n`` elements apart in one untouched
    allocation: only the pages it writes are ever backed by memory."""
    storage = torch.empty((n_rows - 1) * stride_n + width, dtype=dtype)
    return storage.as_strided((1, 1, n_rows, width), (0, 0, stride_n, 1))


@pytest.mark.skipif(ON_GPU, reason="a multi-gigabyte view; the interpreter reads it in place")
def test_block_offsets_past_2_31_elements_are_64_bit() -> None:
    # Rows 2^24 elements apart: query and key block bases beyond row 128 lie past 2^31 elements, while
    # offsets inside a 32-row tile stay below it. 32-bit block offsets would read and write wrong rows.
    from flashattn_teach._validate import inputs as _validate
    from flashattn_teach.triton import launch

    N, D, stride = 136, 16, 2**24
    g = torch.Generator().manual_seed(0)
    small = [torch.randn(1, 1, N, D, generator=g).half() for _ in range(4)]
    q, k = _lazy_rows(N, stride, D, torch.float16), _lazy_rows(N, stride, D, torch.float16)
    q.copy_(small[0])
    k.copy_(small[1])
    v, dO = small[2], small[3]
    q64, k64, v64 = (t.double().requires_grad_() for t in (small[0], small[1], v))
    O, lse = dense_attention(q64, k64, v64, causal=True, return_lse=True)
    want = torch.autograd.grad(O, (q64, k64, v64), dO.double())
    s = _validate.validate_inputs(q, k, v)
    got = launch.backward(
        q, k, v, O.detach().half(), lse.detach().float(), dO, None, s,
        causal=True, causal_align="top_left", config=AttentionConfig.uniform(32, 32),
    )  # fmt: skip
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert_close_scaled(a, b, 2 * REL_TOL[torch.float16], name)


def test_a_tile_whose_offsets_pass_2_31_is_refused() -> None:
    from flashattn_teach.triton import launch

    q = _lazy_rows(2, 2**30, 16, torch.float16)
    with pytest.raises(AttentionValueError, match=r"q \(1, 1, 2, 16\) .* 32 rows spans"):
        launch.check_tile_offsets("backward_dq", 32, q=q)


def _split(config: AttentionConfig) -> AttentionConfig:
    assert config.backward_dkdv is not None
    return dataclasses.replace(config, backward_dkdv=dataclasses.replace(config.backward_dkdv, split=True))


@pytest.mark.parametrize("causal_align", ["top_left", "bottom_right"])
def test_split_dkdv_programs_give_the_joint_kernels_bits(causal_align: str) -> None:
    # dK and dV by separate programs (the hd256 tables) repeat the joint program's operations for each
    c = Case(
        B=2,
        H_kv=2,
        group=2,
        N_q=45,
        N_k=37,
        D=40,
        D_v=24,
        causal=True,
        causal_align=causal_align,
        dtype=torch.float32,
        config=_split(AttentionConfig.uniform(16, 32)),
    )
    q, k, v = c.tensors()
    dO = torch.randn(c.B, c.H_q, c.N_q, c.D_v, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    split = grads(c, q, k, v, dO, None)
    joint = grads(dataclasses.replace(c, config=AttentionConfig.uniform(16, 32)), q, k, v, dO, None)
    for name, a, b in zip(("dq", "dk", "dv"), split, joint, strict=True):
        assert torch.equal(a, b), name
    check_backward(c)


def test_the_shipped_hd256_backward_matches_dense() -> None:
    # the sm90 and sm80 rows at head dim 256 (split dK/dV), in fp16 (bf16 is wrong in the interpreter)
    for arch in ("sm90", "sm80"):
        config = shipped_config(256, torch.float16, arch)
        assert config.backward_dkdv is not None and config.backward_dkdv.split
        c = Case(1, 1, 2, 70, 81, 256, 256, True, "bottom_right", torch.float16, config)
        check_backward(c)


@contextlib.contextmanager
def _launches() -> Iterator[list[tuple[KernelConfig, bool]]]:
    """Records what ``launch.launch_tile`` returns, in launch order: (configuration launched, by TMA)."""
    seen: list[tuple[KernelConfig, bool]] = []
    real = launch.launch_tile

    def recording(c: KernelConfig, *tensors: torch.Tensor, varlen: bool) -> tuple[KernelConfig, bool]:
        seen.append(real(c, *tensors, varlen=varlen))
        return seen[-1]

    launch.launch_tile = recording
    try:
        yield seen
    finally:
        launch.launch_tile = real


def _by_tma(config: AttentionConfig, fused: bool = False) -> AttentionConfig:
    """``config`` with the dK/dV kernel's Q_i, dO_i and the dQ kernel's K_j, V_j read by TMA; the one-kernel
    backward's Q_i, dO_i too with ``fused``, else no one-kernel tile (the two-kernel backward runs)."""
    assert config.backward_dkdv is not None and config.backward_dq is not None
    return dataclasses.replace(
        config,
        backward_dkdv=dataclasses.replace(config.backward_dkdv, tma=True),
        backward_dq=dataclasses.replace(config.backward_dq, tma=True),
        backward_fused=dataclasses.replace(config.backward_dkdv, tma=True) if fused else None,
    )


@settings(max_examples=25)
@given(c=cases(max_n=64))
@example(c=WIDE_GQA)
@example(c=EMPTY_ROWS)
def test_backward_by_tma_descriptors_matches_dense_for_any_shape(c: Case) -> None:
    # the copy engine's zero fill past N and D stands in for the pointer path's masked loads
    c = dataclasses.replace(c, config=_by_tma(c.config))
    with _launches() as seen:
        check_backward(c)
    # the forward, the triton backward's dK/dV and dQ (the oracle's backward launches nothing)
    assert seen == [(c.config.forward, False), (c.config.backward_dkdv, True), (c.config.backward_dq, True)]


def test_bnhd_views_by_tma_match_dense() -> None:
    # (B, N, H, D) tensors seen as (B, H, N, D): the 4-D descriptors take their strides as they are
    g = torch.Generator().manual_seed(10)
    q = torch.randn(2, 41, 4, 40, generator=g).to(DEVICE).transpose(1, 2)
    k, v = (torch.randn(2, 29, 2, 40, generator=g).to(DEVICE).transpose(1, 2) for _ in range(2))
    dO = torch.randn(2, 4, 41, 40, generator=g).to(DEVICE)
    config = _by_tma(AttentionConfig.uniform(32, 16), fused=True)
    c = Case(2, 2, 2, 41, 29, 40, 40, True, "bottom_right", torch.float32, config)
    assert not q.is_contiguous()
    with _launches() as seen:
        got = grads(c, q, k, v, dO)
    assert [by_tma for _, by_tma in seen] == [False, True]  # the forward, the one-kernel backward
    want = grads(c, *(t.double().cpu() for t in (q, k, v, dO)), triton=False)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert_close_scaled(a, b, 2 * REL_TOL[torch.float32], name)


def test_a_tma_tile_falls_back_to_its_pointer_tile_where_tma_cannot_run() -> None:
    # D = 17 in fp16: rows 34 bytes apart, which no tensor descriptor describes; packed sequences never use TMA
    pointer_tile = KernelConfig(16, 16, 4, 1)
    tile = KernelConfig(32, 32, 4, 1, tma=True, fallback=pointer_tile)
    config = dataclasses.replace(AttentionConfig.uniform(32, 16), backward_dkdv=tile, backward_dq=tile)
    for fused in (None, tile):  # the two-kernel backward, then the one-kernel one
        tiles = dataclasses.replace(config, backward_fused=fused)
        c = Case(1, 1, 2, 45, 37, 17, 17, True, "bottom_right", torch.float16, tiles)
        with _launches() as seen:
            check_backward(c)
        backward = [(pointer_tile, False)] * (2 if fused is None else 1)
        assert seen == [(config.forward, False), *backward]
    aligned = torch.zeros(1, 2, 45, 16, dtype=torch.float16, device=DEVICE)
    assert tma.launch_tile(tile, aligned, varlen=True) == (pointer_tile, False)
    assert tma.launch_tile(tile, aligned, varlen=False) == (tile, True)
    # without a fallback the tile itself runs through pointers; a fallback belongs to a TMA tile only
    own = KernelConfig(32, 32, 4, 1, tma=True)
    assert tma.launch_tile(own, aligned, varlen=True) == (KernelConfig(32, 32, 4, 1), False)
    with pytest.raises(AttentionValueError, match="fallback"):
        KernelConfig(32, 32, 4, 1, fallback=pointer_tile)
