"""Packed variable-length sequences: ``flash_attention_varlen`` and the packed part of the mask contract.

The oracle runs the float64 dense reference on each sequence separately, in the ordinary ``(H, N, D)``
layout, and concatenates the results: it never sees ``cu_seqlens``, so it shares no code with
``packed.py``. The tile checks compare against a block-diagonal mask built here from the lengths.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashattn_teach as fa
from flashattn_teach._validate.inputs import validate_inputs
from flashattn_teach.dispatch import planner
from flashattn_teach.masks.causal import TileKind
from flashattn_teach.masks.packed import PackedSequences
from flashattn_teach.masks.spec import MaskSpec
from flashattn_teach.reference import dense_attention, parallel, scores

from probes import patch_everywhere

NEG_INF = float("-inf")
CPU_BACKENDS = ["query_major", "key_major", "parallel", "dense"]
LENGTHS = st.sampled_from([0, 1, 1, 2, 3, 4, 5, 7, 9])
BLOCKS = st.sampled_from([1, 2, 3, 4, 5, 8, 16])


def bounds(lengths: list[int]) -> torch.Tensor:
    """``cu_seqlens`` of the given lengths: ``(B + 1,)`` int32, from 0."""
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


@st.composite
def packed_problems(draw, dtype=torch.float64):
    """Packed q, k, v (empty and length-1 sequences, len_q != len_k, GQA) and a mix of the options."""
    B = draw(st.integers(1, 4))
    lens_q = draw(st.lists(LENGTHS, min_size=B, max_size=B))
    lens_k = lens_q if draw(st.booleans()) else draw(st.lists(LENGTHS, min_size=B, max_size=B))
    H_kv, G = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3]))
    D, D_v = draw(st.sampled_from([1, 3, 4])), draw(st.sampled_from([1, 2, 5]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def make(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()

    q = make(sum(lens_q), H_kv * G, D)
    k, v = make(sum(lens_k), H_kv, D), make(sum(lens_k), H_kv, D_v)
    opts: dict = {"causal": draw(st.booleans()), "causal_align": draw(st.sampled_from(["top_left", "bottom_right"]))}
    if draw(st.booleans()):
        opts["window"] = (draw(st.integers(-1, 4)), draw(st.integers(-1, 4)))
    if draw(st.booleans()):
        opts["softcap"] = draw(st.floats(0.5, 4.0))
    slopes = draw(st.sampled_from([None, (H_kv * G,), (B, H_kv * G)]))
    if slopes is not None:
        opts["alibi_slopes"] = torch.rand(*slopes, generator=g, dtype=dtype)
    return q, k, v, lens_q, lens_k, opts, (draw(BLOCKS), draw(BLOCKS))


def per_sequence_oracle(q, k, v, lens_q, lens_k, *, alibi_slopes=None, causal_align="bottom_right", **opts):
    """``(O, lse)`` in the packed layout, by the dense reference on each sequence alone."""
    O, lse = [], []
    cq, ck = bounds(lens_q).tolist(), bounds(lens_k).tolist()
    for b in range(len(lens_q)):
        # (len, H, D) -> (H, len, D): one sequence in the ordinary layout
        qs, ks, vs = (t[c[b] : c[b + 1]].transpose(0, 1) for t, c in ((q, cq), (k, ck), (v, ck)))
        slopes = None if alibi_slopes is None else alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
        O_b, lse_b = dense_attention(
            qs, ks, vs, enable_gqa=True, causal_align=causal_align, alibi_slopes=slopes, return_lse=True, **opts
        )
        O.append(O_b.transpose(0, 1))
        lse.append(lse_b)
    return torch.cat(O, dim=0), torch.cat(lse, dim=1)


@contextlib.contextmanager
def tiles(block_m: int, block_n: int):
    """Every tiled backend at ``block_m x block_n``, and the parallel one on its pool even for tiny calls."""
    saved, few_rows = dict(planner.TILED), planner.FEW_ROWS
    smallest = parallel.MIN_PARALLEL_SCORES
    planner.TILED.update({name: (order, block_m, block_n) for name, (order, _, _) in saved.items()})
    planner.FEW_ROWS = 0  # no wide key tiles for few rows: the tiles asked for
    parallel.MIN_PARALLEL_SCORES = 0
    try:
        yield
    finally:
        planner.TILED.update(saved)
        planner.FEW_ROWS = few_rows
        parallel.MIN_PARALLEL_SCORES = smallest


def loss(O, lse):
    """Through ``O`` and the finite ``lse`` (a row that sees no key has no lse gradient)."""
    w = torch.linspace(-1, 1, O.shape[-1], dtype=O.dtype)
    return (O * w).sum() + torch.where(torch.isneginf(lse), 0.0, lse).sum()


def assert_lse_equal(lse, ref, atol):
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref))
    finite = ~torch.isneginf(ref)
    torch.testing.assert_close(lse[finite].double(), ref[finite].double(), atol=atol, rtol=0)


def call(q, k, v, lens_q, lens_k, **kwargs):
    return fa.flash_attention_varlen(
        q, k, v, bounds(lens_q), bounds(lens_k), max(lens_q, default=0), max(lens_k, default=0), **kwargs
    )


# ------------------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=30)
@given(case=packed_problems())
def test_varlen_matches_the_per_sequence_oracle_float64(backend, case):
    """Empty and length-1 sequences, len_q != len_k, causal in both alignments, window, softcap, ALiBi per
    head or per sequence, GQA, tiles of any size: values, lse and the gradients of q, k, v."""
    q, k, v, lens_q, lens_k, opts, (block_m, block_n) = case
    with tiles(block_m, block_n):
        O, lse = call(q, k, v, lens_q, lens_k, backend=backend, return_lse=True, **opts)
    O_ref, lse_ref = per_sequence_oracle(q, k, v, lens_q, lens_k, **opts)
    assert O.shape == (q.shape[0], q.shape[1], v.shape[2]) and O.is_contiguous()
    assert lse.shape == (q.shape[1], q.shape[0])
    torch.testing.assert_close(O, O_ref, atol=1e-12, rtol=0)
    assert_lse_equal(lse, lse_ref, 1e-12)
    grads = torch.autograd.grad(loss(O, lse), (q, k, v), allow_unused=True)
    refs = torch.autograd.grad(loss(O_ref, lse_ref), (q, k, v), allow_unused=True)
    for name, t, got, ref in zip("qkv", (q, k, v), grads, refs, strict=True):  # None: t is empty or unused
        got, ref = (torch.zeros_like(t) if g is None else g for g in (got, ref))
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=0, msg=f"d{name}")


@pytest.mark.parametrize("backend", ["query_major", "parallel"])
@settings(max_examples=15)
@given(case=packed_problems(torch.float32))
def test_varlen_float32_matches_the_float64_oracle(backend, case):
    q, k, v, lens_q, lens_k, opts, (block_m, block_n) = case
    with tiles(block_m, block_n):
        O, lse = call(q, k, v, lens_q, lens_k, backend=backend, return_lse=True, **opts)
    assert O.dtype == torch.float32 and lse.dtype == torch.float32
    wide = {n: t.double() if isinstance(t, torch.Tensor) else t for n, t in opts.items()}
    O_ref, lse_ref = per_sequence_oracle(q.double(), k.double(), v.double(), lens_q, lens_k, **wide)
    torch.testing.assert_close(O.double(), O_ref, atol=2e-5, rtol=0)
    assert_lse_equal(lse, lse_ref, 2e-5)


def test_forward_mode_ad_through_packed_sequences_matches_the_oracle():
    """torch.func.jvp runs the query-major reference (auto under a transform) with the packed contract."""
    g = torch.Generator().manual_seed(3)
    lens_q, lens_k = [3, 0, 6, 1], [2, 4, 6, 0]
    q, k, v = (torch.randn(sum(n), 2, 3, generator=g, dtype=torch.float64) for n in (lens_q, lens_k, lens_k))
    tq, tk, tv = (torch.randn_like(t) for t in (q, k, v))
    opts = dict(
        causal=True, window=(2, -1), softcap=3.0, alibi_slopes=torch.rand(4, 2, generator=g, dtype=torch.float64)
    )
    with tiles(2, 3):
        _, tO = torch.func.jvp(lambda *x: call(*x, lens_q, lens_k, **opts), (q, k, v), (tq, tk, tv))
    _, tO_ref = torch.func.jvp(lambda *x: per_sequence_oracle(*x, lens_q, lens_k, **opts)[0], (q, k, v), (tq, tk, tv))
    torch.testing.assert_close(tO, tO_ref, atol=1e-12, rtol=0)


def test_causal_align_defaults_to_bottom_right_per_sequence():
    """flash-attn's varlen convention: a 2-query sequence against 5 keys sees keys j' <= i' + 3."""
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 1, 4, generator=g), torch.randn(5, 1, 4, generator=g), torch.randn(5, 1, 4, generator=g)
    O = call(q, k, v, [2], [5], causal=True)
    expected = dense_attention(*(t.transpose(0, 1) for t in (q, k, v)), causal=True, causal_align="bottom_right")
    torch.testing.assert_close(O, expected.transpose(0, 1))
    top_left = call(q, k, v, [2], [5], causal=True, causal_align="top_left")
    assert not torch.allclose(O, top_left)


# ------------------------------------------------------------------------------------------------ tiles


def block_diagonal(lens_q, lens_k, *, causal, causal_align, window):
    """``(total_q, total_k)`` bool: each sequence's own rule in its own block (built here, not by packed.py)."""
    left, right = window
    right = 0 if causal else right
    M = torch.zeros(sum(lens_q), sum(lens_k), dtype=torch.bool)
    cq, ck = bounds(lens_q).tolist(), bounds(lens_k).tolist()
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k, strict=True)):
        off = n_k - n_q if causal_align == "bottom_right" else 0
        i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
        seen = torch.ones(n_q, n_k, dtype=torch.bool)
        if left >= 0:
            seen &= j >= i + off - left
        if right >= 0:
            seen &= j <= i + off + right
        M[cq[b] : cq[b + 1], ck[b] : ck[b + 1]] = seen
    return M


def packed_spec(lens_q, lens_k, *, causal, causal_align, window):
    qh, kh = torch.zeros(1, sum(lens_q), 1), torch.zeros(1, sum(lens_k), 1)
    shapes = validate_inputs(qh, kh, kh)
    return MaskSpec.build(
        shapes,
        torch.float64,
        causal=causal,
        causal_align=causal_align,
        window=window,
        cu_seqlens_q=bounds(lens_q),
        cu_seqlens_k=bounds(lens_k),
    )


@settings(max_examples=60)
@given(
    lens=st.lists(st.tuples(LENGTHS, LENGTHS), min_size=1, max_size=6),
    causal=st.booleans(),
    causal_align=st.sampled_from(["top_left", "bottom_right"]),
    window=st.tuples(st.integers(-1, 3), st.integers(-1, 3)),
    block_m=BLOCKS,
    block_n=BLOCKS,
)
def test_every_tile_kind_and_loop_range_agrees_with_the_block_diagonal(
    lens, causal, causal_align, window, block_m, block_n
):
    """SKIP iff no element of the tile is visible, FULL only if all are; the loops' block lists are exactly
    the non-SKIP tiles; each tile's element mask equals the block-diagonal mask's piece."""
    lens_q, lens_k = [a for a, _ in lens], [b for _, b in lens]
    M = block_diagonal(lens_q, lens_k, causal=causal, causal_align=causal_align, window=window)
    spec = packed_spec(lens_q, lens_k, causal=causal, causal_align=causal_align, window=window)
    tiling = spec.tiling(block_m, block_n)
    for i, (r0, r1) in enumerate(tiling.row_blocks):
        for j, (c0, c1) in enumerate(tiling.col_blocks):
            piece = M[r0:r1, c0:c1]
            kind = tiling.kind(i, j)
            assert (kind is TileKind.SKIP) == (not piece.any()), (i, j)
            if kind is TileKind.FULL:
                assert piece.all(), (i, j)
            assert torch.equal(spec.structure_visible(r0, r1, c0, c1, torch.device("cpu")), piece), (i, j)
        assert tiling.key_blocks(i) == [j for j, (c0, c1) in enumerate(tiling.col_blocks) if M[r0:r1, c0:c1].any()]
    for j, (c0, c1) in enumerate(tiling.col_blocks):
        assert tiling.query_blocks(j) == [i for i, (r0, r1) in enumerate(tiling.row_blocks) if M[r0:r1, c0:c1].any()]
        # parallel.py cuts each tile to query_range's rows: every row that sees a key of the block is in it
        lo, hi = spec.query_range(c0, c1)
        seen_by = M[:, c0:c1].any(dim=1).nonzero().flatten().tolist()
        assert all(lo <= r < hi for r in seen_by)


def test_many_short_sequences_visit_only_the_block_diagonal(monkeypatch):
    """64 sequences of 8 at 8 x 8 tiles: exactly the 64 diagonal tiles run, and the loops ask for the
    kind of O(T_r + T_c) tiles, not all T_r x T_c = 4096."""
    visited, asked = [], []
    score_tile, kind = scores.score_tile, PackedSequences.kind

    def counting_score_tile(q_i, k_j, scale, allowed=None, **variants):
        visited.append((q_i.shape[-2], k_j.shape[-2]))
        return score_tile(q_i, k_j, scale, allowed, **variants)

    def counting_kind(self, *args):
        asked.append(args)
        return kind(self, *args)

    patch_everywhere(monkeypatch, scores, "score_tile", counting_score_tile)
    monkeypatch.setattr(PackedSequences, "kind", counting_kind)
    lengths = [8] * 64
    q, k, v = (torch.randn(512, 2, 4) for _ in range(3))
    for backend in ("query_major", "key_major"):
        visited.clear()
        asked.clear()
        with tiles(8, 8):
            call(q, k, v, lengths, lengths, backend=backend)
        assert visited == [(8, 8)] * 64, backend
        assert len(asked) <= 3 * (64 + 64), backend


def test_ragged_sequences_visit_only_the_tiles_they_see(monkeypatch):
    """Lengths that cut tiles: the tiles run are exactly those holding a visible (row, key) pair."""
    visited = []
    score_tile = scores.score_tile

    def counting_score_tile(q_i, k_j, scale, allowed=None, **variants):
        visited.append(1)
        return score_tile(q_i, k_j, scale, allowed, **variants)

    patch_everywhere(monkeypatch, scores, "score_tile", counting_score_tile)
    lens_q, lens_k = [5, 0, 13, 1, 7, 9, 2], [3, 4, 13, 6, 0, 11, 2]
    q, k, v = torch.randn(sum(lens_q), 1, 4), torch.randn(sum(lens_k), 1, 4), torch.randn(sum(lens_k), 1, 4)
    M = block_diagonal(lens_q, lens_k, causal=True, causal_align="bottom_right", window=(3, -1))
    needed = sum(bool(M[r : r + 4, c : c + 4].any()) for r in range(0, M.shape[0], 4) for c in range(0, M.shape[1], 4))
    with tiles(4, 4):
        call(q, k, v, lens_q, lens_k, causal=True, window=(3, -1), backend="query_major")
    assert len(visited) == needed


# ------------------------------------------------------------------------------------------------ errors


def good():
    q, k, v = torch.randn(5, 2, 4), torch.randn(7, 1, 4), torch.randn(7, 1, 3)
    return dict(
        q=q,
        k=k,
        v=v,
        cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 4, 7], dtype=torch.int32),
        max_seqlen_q=3,
        max_seqlen_k=4,
    )


BAD = [
    (dict(cu_seqlens_q=torch.tensor([[0, 2, 5]])), ValueError, r"cu_seqlens_q must be 1-D"),
    (dict(cu_seqlens_k=torch.tensor([], dtype=torch.int64)), ValueError, r"cu_seqlens_k must be 1-D"),
    (dict(cu_seqlens_q=torch.tensor([1, 2, 5])), ValueError, r"cu_seqlens_q must start at 0"),
    (dict(cu_seqlens_k=torch.tensor([0, 5, 4, 7])), ValueError, r"cu_seqlens_k must be non-decreasing.*\[1\] = 5"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 4])), ValueError, r"cu_seqlens_q must end at total_q = q.shape\[0\] = 5"),
    (dict(cu_seqlens_k=torch.tensor([0, 7])), ValueError, r"same number of sequences, got 2 .* and 1"),
    (dict(cu_seqlens_q=torch.tensor([0.0, 2.0, 5.0])), TypeError, r"cu_seqlens_q must be int32 or int64"),
    (dict(cu_seqlens_k=[0, 4, 7]), TypeError, r"cu_seqlens_k must be a torch.Tensor"),
    (dict(max_seqlen_q=2), ValueError, r"max_seqlen_q = 2 is smaller than sequence 1's length 3"),
    (dict(max_seqlen_k=3), ValueError, r"max_seqlen_k = 3 is smaller than sequence 0's length 4"),
    (dict(max_seqlen_k=4.0), TypeError, r"max_seqlen_k must be an int"),
    (dict(q=torch.randn(1, 5, 2, 4)), ValueError, r"q must have shape \(total_q, H_q, D\)"),
    (dict(v=torch.randn(6, 1, 3)), ValueError, r"k and v must share total_k and H_kv"),
    (dict(k=torch.randn(7, 1, 3), v=torch.randn(7, 1, 3)), ValueError, r"same head dimension D"),
    (dict(alibi_slopes=torch.rand(3, 2)), ValueError, r"alibi_slopes must have shape \(2,\) or \(2, 2\)"),
    (dict(window=(-2, 0)), ValueError, r"window left must be -1"),
    (dict(softcap=-0.5), ValueError, r"softcap must be a finite number > 0"),
    (dict(max_seqlen_q=-1), ValueError, r"max_seqlen_q must be at least 0"),
    (dict(causal_align="middle"), ValueError, r"causal_align must be one of"),
    (dict(backend="bogus"), ValueError, r"backend must be one of"),
]


@pytest.mark.parametrize("change, error, match", BAD)
def test_bad_varlen_input_is_named(change, error, match):
    args = {**good(), **change}
    with pytest.raises(error, match=match):
        fa.flash_attention_varlen(**args)


def test_gqa_heads_that_do_not_divide_are_refused():
    args = {**good(), "q": torch.randn(5, 3, 4), "k": torch.randn(7, 2, 4), "v": torch.randn(7, 2, 3)}
    with pytest.raises(ValueError, match=r"H_q=3 must be a multiple of the key/value heads H_kv=2"):
        fa.flash_attention_varlen(**args)


def test_dropout_out_of_range_is_named():
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\], got 1.5"):
        fa.flash_attention_varlen(**good(), dropout_p=1.5)
