"""The kernels' loop bounds agree with the tile geometry of :mod:`flashattn_teach.masks.causal`.

A probe kernel stores what ``_causal_key_range`` (forward and dQ) and ``_causal_query_range`` (dK/dV)
return for every block; each bound is then checked against ``key_end``, ``first_visible_row`` and
``tile_kind``: the unmasked stages hold only full tiles of in-range rows and keys, and no visible tile is
left out.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402
from _triton_cases import DEVICE  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from triton import language as tl  # noqa: E402

from flashattn_teach.masks.causal import TileKind, diagonal_offset, first_visible_row, key_end, tile_kind  # noqa: E402
from flashattn_teach.triton.kernels.backward import _causal_query_range  # noqa: E402
from flashattn_teach.triton.kernels.forward import _causal_key_range  # noqa: E402


@triton.jit
def _ranges_probe(
    KEY_RANGE,  # (cdiv(N_q, BLOCK_M), 2) int32: full_end, end of query block i
    QUERY_RANGE,  # (cdiv(N_k, BLOCK_N), 3) int32: begin, diag_end, full_end of key block j
    N_q,
    N_k,
    OFFSET,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    block = tl.program_id(0)
    if block * BLOCK_M < N_q:
        full_end, end = _causal_key_range(block * BLOCK_M, N_k, OFFSET, BLOCK_M, BLOCK_N, CAUSAL)
        tl.store(KEY_RANGE + block * 2, full_end)
        tl.store(KEY_RANGE + block * 2 + 1, end)
    if block * BLOCK_N < N_k:
        begin, diag_end, full_end = _causal_query_range(block * BLOCK_N, N_q, OFFSET, BLOCK_M, BLOCK_N, CAUSAL)
        tl.store(QUERY_RANGE + block * 3, begin)
        tl.store(QUERY_RANGE + block * 3 + 1, diag_end)
        tl.store(QUERY_RANGE + block * 3 + 2, full_end)


def probe(N_q: int, N_k: int, offset: int, BM: int, BN: int, causal: bool) -> tuple[list, list]:
    key_range = torch.zeros(triton.cdiv(N_q, BM), 2, dtype=torch.int32, device=DEVICE)
    query_range = torch.zeros(triton.cdiv(N_k, BN), 3, dtype=torch.int32, device=DEVICE)
    grid = (max(len(key_range), len(query_range)),)
    _ranges_probe[grid](key_range, query_range, N_q, N_k, offset, BLOCK_M=BM, BLOCK_N=BN, CAUSAL=causal)
    return key_range.tolist(), query_range.tolist()


def full(r0: int, r1: int, c0: int, c1: int, causal: bool, offset: int) -> bool:
    return not causal or tile_kind(r0, r1, c0, c1, offset) is TileKind.FULL


def visible_somewhere(r0: int, r1: int, c0: int, c1: int, causal: bool, offset: int) -> bool:
    return not causal or tile_kind(r0, r1, c0, c1, offset) is not TileKind.SKIP


@settings(max_examples=100)  # cheap: the probe is scalar arithmetic
@given(
    N_q=st.integers(1, 100),
    N_k=st.integers(1, 100),
    causal_align=st.sampled_from(["top_left", "bottom_right"]),
    BM=st.sampled_from([16, 32]),
    BN=st.sampled_from([16, 32]),
    causal=st.booleans(),
)
def test_kernel_loop_bounds_match_the_causal_tile_geometry(
    N_q: int, N_k: int, causal_align: str, BM: int, BN: int, causal: bool
) -> None:
    offset = diagonal_offset(N_q, N_k, causal_align)
    key_ranges, query_ranges = probe(N_q, N_k, offset, BM, BN, causal)

    for i, (full_end, end) in enumerate(key_ranges):  # query block i: rows [r0, r1)
        r0, r1 = i * BM, (i + 1) * BM
        assert end == key_end(r1, N_k, causal, offset)
        assert full_end % BN == 0 and full_end <= end
        for c0 in range(0, full_end, BN):  # the unmasked stage: whole key blocks, every pair visible
            assert c0 + BN <= N_k and full(r0, r1, c0, c0 + BN, causal, offset)
        for c0 in range(0, N_k, BN):  # blocks the loop never reaches hold no visible pair
            assert c0 < end or not visible_somewhere(r0, r1, c0, c0 + BN, causal, offset)

    for j, (begin, diag_end, full_end) in enumerate(query_ranges):  # key block j: keys [c0, c1)
        c0, c1 = j * BN, (j + 1) * BN
        assert begin == first_visible_row(c0, causal, offset) // BM * BM
        assert begin <= diag_end <= full_end and begin % BM == diag_end % BM == full_end % BM == 0
        for r0 in range(0, begin, BM):  # skipped: no row of these blocks sees a key of this block
            assert not visible_somewhere(r0, r0 + BM, c0, c1, causal, offset)
        for r0 in range(diag_end, full_end, BM):  # the unmasked stage: whole query blocks, every pair visible
            assert r0 + BM <= N_q and full(r0, r0 + BM, c0, c1, causal, offset)
