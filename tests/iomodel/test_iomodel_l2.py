"""The IO model's L2 level: K/V reuse across the programs resident at once, against an LRU simulation of
the grid and hand counts."""

from __future__ import annotations

import itertools
import math

import pytest

from flashattn_teach.tools import iomodel
from flashattn_teach.tools.iomodel import Problem

H200 = iomodel.L2Cache()  # 50 MiB, 132 programs
RIDGE = 989 / 4.8  # H200 dense bf16 FLOP/s over HBM bytes/s


def _lru_forward_kv_bytes(p: Problem, bm: int, bn: int, programs: int, l2_bytes: float) -> int:
    """K/V bytes that reach HBM when the forward's 1-D grid (block fastest, causal blocks longest first, as in
    flashattn_teach.triton) runs ``programs`` at a time, one key tile per program per tick, through an LRU
    cache of ``l2_bytes``: a simulation, independent of the model's window formula."""
    N, d, e = p.seq_len, p.head_dim, p.elem_bytes
    t_r = math.ceil(N / bm)
    grid = []
    for bh in range(p.batch * p.heads):
        for k in range(t_r):
            i = t_r - 1 - k if p.causal else k
            last = _visible_key_rows(p, min((i + 1) * bm, N), bn)
            grid.append([(bh, c0) for c0 in range(0, last, bn)])
    waiting, running = iter(grid), []
    lru: dict[tuple[int, int], int] = {}  # insertion order = recency
    loads = 0
    while True:
        running += [iter(tiles) for tiles in itertools.islice(waiting, programs - len(running))]
        if not running:
            return loads
        still = []
        for prog in running:
            tile = next(prog, None)
            if tile is None:
                continue
            still.append(prog)
            size = 2 * (min(tile[1] + bn, N) - tile[1]) * d * e  # K_j and V_j
            if tile in lru:
                lru[tile] = lru.pop(tile)
                continue
            loads += size
            lru[tile] = size
            while sum(lru.values()) > l2_bytes:
                del lru[next(iter(lru))]
        running = still


def _visible_key_rows(p: Problem, r1: int, bn: int) -> int:
    return min(p.seq_len, math.ceil(r1 / bn) * bn) if p.causal else p.seq_len


@pytest.mark.parametrize("programs", [1, 2, 3, 5, 13])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("N", "bm", "bn", "heads"), [(37, 8, 8, 3), (64, 16, 8, 4), (100, 8, 32, 3), (64, 16, 32, 1)])
def test_when_the_model_says_fits_an_lru_simulation_reads_kv_once_per_head(N, bm, bn, heads, causal, programs):
    p = Problem(1, heads, N, 4, elem_bytes=2, causal=causal)
    fig = iomodel.query_major_forward_l2(p, bm, bn, iomodel.L2Cache(0, programs))
    r = fig.passes[0]
    once = heads * 2 * N * 4 * 2
    assert _lru_forward_kv_bytes(p, bm, bn, programs, r.resident_bytes) == once
    # at no size does the simulation exceed the no-reuse count, which the model falls back to
    assert _lru_forward_kv_bytes(p, bm, bn, programs, 0) <= fig.without_l2.reads["K"] + fig.without_l2.reads["V"]


def test_the_lru_simulation_sees_misses_when_the_resident_heads_do_not_fit():
    """Negative control: 3 query blocks per head, 2 programs at once, so head 0's last block starts a wave
    after its first two; with room for one head's K/V it re-reads them, with room for two it does not."""
    p = Problem(1, 2, 24, 4, elem_bytes=2)
    r = iomodel.query_major_forward_l2(p, 8, 8, iomodel.L2Cache(0, 2)).passes[0]
    assert (r.blocks_per_head, r.heads_resident) == (3, 2)
    once = 2 * 2 * 24 * 4 * 2
    assert _lru_forward_kv_bytes(p, 8, 8, 2, r.head_bytes) > once
    assert _lru_forward_kv_bytes(p, 8, 8, 2, r.resident_bytes) == once


@pytest.mark.parametrize("pairs", [1, 2, 5])
@pytest.mark.parametrize("blocks_per_head", [1, 3, 4])
@pytest.mark.parametrize("programs", [1, 2, 3, 4, 7, 12])
def test_resident_heads_is_the_most_pairs_a_window_of_consecutive_pids_touches(programs, blocks_per_head, pairs):
    total = pairs * blocks_per_head
    most = max(
        len({pid // blocks_per_head for pid in range(start, min(start + programs, total))}) for start in range(total)
    )
    assert iomodel.resident_heads(programs, blocks_per_head, pairs) == most


def test_l2_reuse_traffic_equals_a_hand_count():
    # B=1, H=2, N=8, d=4, 2-byte elements, 4x4 blocks: 2 query blocks per head; 2 programs -> both heads at once
    p = Problem(1, 2, 8, 4, elem_bytes=2)
    head = 2 * 8 * 4 * 2  # K and V of one head: 128 bytes
    fits = iomodel.query_major_forward_l2(p, 4, 4, iomodel.L2Cache(2 * head, programs=2))
    assert fits.fits and fits.passes[0].resident_bytes == 256
    assert fits.with_l2.reads == {"Q": 128, "K": 128, "V": 128}  # 2 heads x 8 x 4 x 2 bytes each
    assert fits.with_l2.writes == {"O": 128, "lse": 2 * 8 * 4}
    assert fits.without_l2.reads == {"Q": 128, "K": 256, "V": 256}  # K, V once per query block: twice
    short = iomodel.query_major_forward_l2(p, 4, 4, iomodel.L2Cache(2 * head - 1, programs=2))
    assert not short.fits and short.with_l2 == short.without_l2
    # one program at a time holds one head's K/V: 128 bytes of L2 suffice
    assert iomodel.query_major_forward_l2(p, 4, 4, iomodel.L2Cache(head, programs=1)).fits


def test_backward_l2_reuse_equals_a_hand_count():
    # N=8, d=4, e=2, BLOCK_M=4, BLOCK_N=2: 4 dK/dV programs per head re-read Q, dO, lse2, delta; 2 dQ programs K, V
    p = Problem(1, 1, 8, 4, elem_bytes=2)
    fig = iomodel.split_backward_l2(p, 4, 2, iomodel.L2Cache(1e9))
    dkdv, dq = fig.passes
    assert (dkdv.blocks_per_head, dkdv.head_bytes, dq.blocks_per_head, dq.head_bytes) == (4, 2 * 64 + 2 * 32, 2, 128)
    matrix, stat = 8 * 4 * 2, 8 * 4
    assert fig.with_l2.reads == {
        "O": matrix,  # preprocess
        "dO": 3 * matrix,  # preprocess, dK/dV (once, from L2), dQ
        "Q": 2 * matrix,
        "K": 2 * matrix,  # dK/dV once, dQ once (from L2)
        "V": 2 * matrix,
        "lse": stat,  # preprocess
        "lse2": 2 * stat,
        "delta": 2 * stat,
    }
    assert fig.without_l2.reads["Q"] == (4 + 1) * matrix and fig.without_l2.reads["K"] == (1 + 2) * matrix
    assert fig.with_l2.writes == fig.without_l2.writes


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("N", "bm", "bn"), [(37, 8, 16), (1000, 128, 64), (4096, 64, 128)])
def test_an_l2_of_zero_gives_the_no_reuse_count_and_a_huge_one_reads_each_head_once(N, bm, bn, causal):
    B, H, d, e = 2, 3, 16, 2
    p = Problem(B, H, N, d, elem_bytes=e, causal=causal)
    for fig in (
        iomodel.query_major_forward_l2(p, bm, bn, iomodel.L2Cache(0)),
        iomodel.split_backward_l2(p, bm, bn, iomodel.L2Cache(0)),
    ):
        assert not fig.fits and fig.with_l2 == fig.without_l2
    assert iomodel.query_major_forward_l2(p, bm, bn, iomodel.L2Cache(0)).without_l2 == (
        iomodel.query_major_forward_io(p, bm, bn)
    )
    once = B * H * N * d * e
    fwd = iomodel.query_major_forward_l2(p, bm, bn, iomodel.L2Cache(math.inf))
    bwd = iomodel.split_backward_l2(p, bm, bn, iomodel.L2Cache(math.inf))
    assert fwd.fits and fwd.with_l2.reads == {"Q": once, "K": once, "V": once}
    assert bwd.fits and bwd.with_l2.reads["K"] == bwd.with_l2.reads["V"] == 2 * once  # dK/dV pass, dQ pass
    assert bwd.with_l2.reads["lse2"] == 2 * B * H * N * 4
    assert bwd.with_l2.total_bytes < bwd.without_l2.total_bytes


def test_at_h200_settings_l2_reuse_lifts_fa2_above_the_ridge_point():
    """N = 8192, d = 128: without L2 the FA2 forward sits at 126 FLOP/B, below 206; with L2 far above."""
    for B, H in [(1, 1), (4, 32)]:
        p = Problem(B, H, 8192, 128)
        fwd = iomodel.query_major_forward_l2(p, 128, 64, H200)
        bwd = iomodel.split_backward_l2(p, 128, 64, H200)
        assert fwd.fits and bwd.fits
        assert iomodel.attention_flops(p) / fwd.without_l2.total_bytes < RIDGE
        assert iomodel.attention_flops(p) / fwd.with_l2.total_bytes > RIDGE
        assert iomodel.attention_flops(p, "backward") / bwd.without_l2.total_bytes < RIDGE
        assert iomodel.attention_flops(p, "backward") / bwd.with_l2.total_bytes > RIDGE
    # at N = 131072, 32 heads, two heads' K/V (2 x 64 MiB) overflow 50 MiB: the model falls back
    long = iomodel.query_major_forward_l2(Problem(1, 32, 131072, 128), 128, 64, H200)
    assert not long.fits and long.with_l2 == long.without_l2
