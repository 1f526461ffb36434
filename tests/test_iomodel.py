"""The IO model against independent counts: tiled schedules run in numpy through a counting "HBM"."""

from __future__ import annotations

import argparse
import itertools
import math
import re
from collections import Counter

import numpy as np
import pytest

from flashattn_teach import iomodel
from flashattn_teach.cli import main
from flashattn_teach.iomodel import Problem

STATS = {"l", "m", "lse", "lse2", "delta"}


class HBM:
    """Named arrays whose every block load and store is counted, in elements."""

    def __init__(self, **arrays: np.ndarray) -> None:
        self.arrays = dict(arrays)
        self.reads: Counter[str] = Counter()
        self.writes: Counter[str] = Counter()

    def load(self, name: str, r0: int, r1: int) -> np.ndarray:
        block = self.arrays[name][r0:r1].copy()
        self.reads[name] += block.size
        return block

    def store(self, name: str, r0: int, r1: int, value: np.ndarray) -> None:
        self.arrays[name][r0:r1] = value
        self.writes[name] += np.asarray(value).size

    def bytes(self, elem_bytes: int) -> tuple[dict[str, int], dict[str, int]]:
        def conv(c: Counter[str]) -> dict[str, int]:
            return {k: n * (4 if k in STATS else elem_bytes) for k, n in c.items()}

        return conv(self.reads), conv(self.writes)


def _tile_visible(r0: int, r1: int, c0: int, c1: int, causal: bool) -> bool:
    """Some query row r in [r0, r1) sees some key c in [c0, c1): c <= r (top-left causal)."""
    return not causal or any(c <= r for r in range(r0, r1) for c in range(c0, c1))


def _mask(r0, r1, c0, c1, causal):
    rows, cols = np.arange(r0, r1)[:, None], np.arange(c0, c1)[None, :]
    return cols <= rows if causal else np.ones((r1 - r0, c1 - c0), dtype=bool)


def _dense(q, k, v, causal):
    N = q.shape[0]
    s = q @ k.T / math.sqrt(q.shape[1])
    s = np.where(_mask(0, N, 0, N, causal), s, -np.inf)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v, p / p.sum(axis=1, keepdims=True)


def _key_major_forward(hbm: HBM, N: int, d: int, bm: int, bn: int, causal: bool) -> None:
    """FA1 Alg. 1 with every HBM access made through ``hbm``."""
    hbm.store("O", 0, N, np.zeros((N, d)))
    hbm.store("l", 0, N, np.zeros(N))
    hbm.store("m", 0, N, np.full(N, -np.inf))
    for c0 in range(0, N, bn):
        c1 = min(c0 + bn, N)
        k_j, v_j = hbm.load("K", c0, c1), hbm.load("V", c0, c1)
        for r0 in range(0, N, bm):
            r1 = min(r0 + bm, N)
            if not _tile_visible(r0, r1, c0, c1, causal):
                continue
            q_i, o_i, l_i, m_i = (hbm.load(x, r0, r1) for x in ("Q", "O", "l", "m"))
            s = np.where(_mask(r0, r1, c0, c1, causal), q_i @ k_j.T / math.sqrt(d), -np.inf)
            m_new = np.maximum(m_i, s.max(axis=1))  # -inf for a row that has seen no key yet
            p = np.exp(s - np.where(np.isinf(m_new), 0, m_new)[:, None])
            with np.errstate(invalid="ignore"):  # -inf - -inf in rows that have seen no key
                alpha = np.exp(np.where(np.isinf(m_i), -np.inf, m_i - m_new))
            l_new = alpha * l_i + p.sum(axis=1)
            acc = (alpha * l_i)[:, None] * o_i + p @ v_j
            hbm.store("O", r0, r1, acc / np.where(l_new == 0, 1, l_new)[:, None])
            hbm.store("l", r0, r1, l_new)
            hbm.store("m", r0, r1, m_new)


def _query_major_forward(hbm: HBM, N: int, d: int, bm: int, bn: int, causal: bool) -> None:
    """FA2's forward with every HBM access made through ``hbm``."""
    for r0 in range(0, N, bm):
        r1 = min(r0 + bm, N)
        q_i = hbm.load("Q", r0, r1)
        m_i, l_i, acc = np.full(r1 - r0, -np.inf), np.zeros(r1 - r0), np.zeros((r1 - r0, d))
        for c0 in range(0, N, bn):
            c1 = min(c0 + bn, N)
            if not _tile_visible(r0, r1, c0, c1, causal):
                continue
            k_j, v_j = hbm.load("K", c0, c1), hbm.load("V", c0, c1)
            s = np.where(_mask(r0, r1, c0, c1, causal), q_i @ k_j.T / math.sqrt(d), -np.inf)
            m_new = np.maximum(m_i, s.max(axis=1))
            p = np.exp(s - m_new[:, None])
            alpha = np.exp(m_i - m_new)
            l_i, acc, m_i = alpha * l_i + p.sum(axis=1), alpha[:, None] * acc + p @ v_j, m_new
        hbm.store("O", r0, r1, acc / l_i[:, None])
        hbm.store("lse", r0, r1, m_i + np.log(l_i))


def _split_backward(hbm: HBM, N: int, d: int, bm: int, bn: int, causal: bool) -> None:
    """Preprocess, dK/dV pass (key blocks outside), dQ pass (query blocks outside), counted."""
    scale = 1 / math.sqrt(d)
    for r0 in range(0, N, bm):
        r1 = min(r0 + bm, N)
        hbm.store("delta", r0, r1, (hbm.load("O", r0, r1) * hbm.load("dO", r0, r1)).sum(axis=1))
        hbm.store("lse2", r0, r1, hbm.load("lse", r0, r1) * math.log2(math.e))

    def tile(r0, r1, c0, c1, q_i, k_j, lse2_i):
        s = np.where(_mask(r0, r1, c0, c1, causal), q_i @ k_j.T * scale, -np.inf)
        return np.exp2(s * math.log2(math.e) - lse2_i[:, None])

    for c0 in range(0, N, bn):
        c1 = min(c0 + bn, N)
        k_j, v_j = hbm.load("K", c0, c1), hbm.load("V", c0, c1)
        dk, dv = np.zeros_like(k_j), np.zeros_like(v_j)
        for r0 in range(0, N, bm):
            r1 = min(r0 + bm, N)
            if not _tile_visible(r0, r1, c0, c1, causal):
                continue
            q_i, do_i, lse2_i, delta_i = (hbm.load(x, r0, r1) for x in ("Q", "dO", "lse2", "delta"))
            p = tile(r0, r1, c0, c1, q_i, k_j, lse2_i)
            dv += p.T @ do_i
            ds = p * (do_i @ v_j.T - delta_i[:, None])
            dk += scale * ds.T @ q_i
        hbm.store("dK", c0, c1, dk)
        hbm.store("dV", c0, c1, dv)
    for r0 in range(0, N, bm):
        r1 = min(r0 + bm, N)
        q_i, do_i, lse2_i, delta_i = (hbm.load(x, r0, r1) for x in ("Q", "dO", "lse2", "delta"))
        dq = np.zeros_like(q_i)
        for c0 in range(0, N, bn):
            c1 = min(c0 + bn, N)
            if not _tile_visible(r0, r1, c0, c1, causal):
                continue
            k_j, v_j = hbm.load("K", c0, c1), hbm.load("V", c0, c1)
            p = tile(r0, r1, c0, c1, q_i, k_j, lse2_i)
            dq += scale * (p * (do_i @ v_j.T - delta_i[:, None])) @ k_j
        hbm.store("dQ", r0, r1, dq)


CASES = [
    (37, 8, 8, 16, False),
    (37, 8, 8, 16, True),
    (64, 4, 16, 16, True),
    (50, 6, 32, 7, True),
    (50, 6, 7, 32, False),
    (19, 4, 64, 64, True),
]


def _inputs(N, d, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((N, d)) for _ in range(4))


@pytest.mark.parametrize(("N", "d", "bm", "bn", "causal"), CASES)
@pytest.mark.parametrize("order", ["key_major", "query_major"])
def test_tiled_forward_traffic_equals_a_counted_run_of_the_schedule(N, d, bm, bn, causal, order):
    q, k, v, _ = _inputs(N, d)
    hbm = HBM(Q=q, K=k, V=v, O=np.zeros((N, d)), l=np.zeros(N), m=np.zeros(N), lse=np.zeros(N))
    run, model = {
        "key_major": (_key_major_forward, iomodel.key_major_forward_io),
        "query_major": (_query_major_forward, iomodel.query_major_forward_io),
    }[order]
    run(hbm, N, d, bm, bn, causal)
    np.testing.assert_allclose(hbm.arrays["O"], _dense(q, k, v, causal)[0], atol=1e-12)  # the schedule is right
    reads, writes = hbm.bytes(elem_bytes=2)
    t = model(Problem(1, 1, N, d, elem_bytes=2, causal=causal), bm, bn)
    assert (t.reads, t.writes) == (reads, writes)


@pytest.mark.parametrize(("N", "d", "bm", "bn", "causal"), CASES)
def test_split_backward_traffic_equals_a_counted_run_of_the_schedule(N, d, bm, bn, causal):
    q, k, v, do = _inputs(N, d)
    o, p = _dense(q, k, v, causal)
    lse = np.log(np.where(_mask(0, N, 0, N, causal), np.exp(q @ k.T / math.sqrt(d)), 0).sum(axis=1))
    hbm = HBM(
        Q=q,
        K=k,
        V=v,
        O=o,
        dO=do,
        lse=lse,
        delta=np.zeros(N),
        lse2=np.zeros(N),
        dQ=np.zeros((N, d)),
        dK=np.zeros((N, d)),
        dV=np.zeros((N, d)),
    )
    _split_backward(hbm, N, d, bm, bn, causal)
    dp = do @ v.T
    ds = p * (dp - (dp * p).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(hbm.arrays["dV"], p.T @ do, atol=1e-10)
    np.testing.assert_allclose(hbm.arrays["dQ"], ds @ k / math.sqrt(d), atol=1e-10)
    np.testing.assert_allclose(hbm.arrays["dK"], ds.T @ q / math.sqrt(d), atol=1e-10)
    reads, writes = hbm.bytes(elem_bytes=4)
    t = iomodel.split_backward_io(Problem(1, 1, N, d, elem_bytes=4, causal=causal), bm, bn)
    assert (t.reads, t.writes) == (reads, writes)


def test_key_major_backward_rereads_q_o_do_dq_once_per_visible_tile():
    N, d, bm, bn = 40, 8, 8, 16
    p = Problem(1, 1, N, d, elem_bytes=1, causal=True)
    visible_rows = sum(
        min(r0 + bm, N) - r0
        for c0 in range(0, N, bn)
        for r0 in range(0, N, bm)
        if _tile_visible(r0, min(r0 + bm, N), c0, min(c0 + bn, N), True)
    )
    t = iomodel.key_major_backward_io(p, bm, bn)
    assert t.reads["Q"] == t.reads["O"] == t.reads["dO"] == t.reads["dQ"] == visible_rows * d
    assert t.reads["l"] == t.reads["m"] == 4 * visible_rows
    assert t.writes == {"dQ": N * d + visible_rows * d, "dK": N * d, "dV": N * d}


def test_standard_attention_moves_4n2_plus_4nd_forward_and_7n2_plus_8nd_backward():
    B, H, N, d, e = 2, 3, 100, 16, 2
    p = Problem(B, H, N, d, elem_bytes=e)
    assert iomodel.standard_forward_io(p).total_bytes == B * H * e * (4 * N * N + 4 * N * d)
    assert iomodel.standard_forward_io(p).write_bytes == B * H * e * (2 * N * N + N * d)
    assert iomodel.standard_backward_io(p).total_bytes == B * H * e * (7 * N * N + 8 * N * d)
    # Causal masking does not shrink the standard algorithm's traffic: S is stored whole.
    assert iomodel.standard_forward_io(Problem(B, H, N, d, e, causal=True)) == iomodel.standard_forward_io(p)


def test_traffic_scales_with_batch_times_heads():
    one = iomodel.query_major_forward_io(Problem(1, 1, 300, 32, causal=True), 64, 32)
    many = iomodel.query_major_forward_io(Problem(3, 5, 300, 32, causal=True), 64, 32)
    assert many.reads == {k: 15 * n for k, n in one.reads.items()}


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sram_kib", [64, 100, 228])
@pytest.mark.parametrize("N", [4096, 16384])
def test_flashattention_traffic_is_theta_n2_d2_over_m(N, d, sram_kib):
    """Theorem 2: with the paper's block sizes, traffic / (N^2 d^2 / M) stays within constant bounds."""
    p = Problem(1, 1, N, d, elem_bytes=2)
    sram = sram_kib * 1024
    br, bc = iomodel.paper_block_sizes(sram, d, 2)
    ratio = iomodel.key_major_forward_io(p, br, bc).total_bytes / iomodel.theorem2_scale(p, sram)
    assert 6 <= ratio <= 30
    bwd = iomodel.key_major_backward_io(p, br, bc).total_bytes / iomodel.theorem2_scale(p, sram)
    assert 8 <= bwd <= 40


def test_doubling_sram_halves_tiled_traffic_but_not_standard():
    p = Problem(1, 1, 16384, 64, elem_bytes=2)

    def tiled(sram):
        return iomodel.key_major_forward_io(p, *iomodel.paper_block_sizes(sram, 64, 2)).total_bytes

    assert 0.45 <= tiled(2 * 96 * 1024) / tiled(96 * 1024) <= 0.6
    assert tiled(96 * 1024) < iomodel.standard_forward_io(p).total_bytes / 3


def test_doubling_n_quadruples_tiled_and_standard_traffic_asymptotically():
    def ratio(fn):
        return fn(Problem(1, 1, 32768, 64)).total_bytes / fn(Problem(1, 1, 16384, 64)).total_bytes

    assert 3.9 <= ratio(iomodel.standard_forward_io) <= 4.0
    assert 3.9 <= ratio(lambda p: iomodel.query_major_forward_io(p, 128, 64)) <= 4.0


def test_causal_skips_about_half_the_tiles():
    full = iomodel.query_major_forward_io(Problem(1, 1, 8192, 64), 128, 64)
    causal = iomodel.query_major_forward_io(Problem(1, 1, 8192, 64, causal=True), 128, 64)
    assert 0.5 <= causal.reads["K"] / full.reads["K"] <= 0.52


def test_flops_follow_the_papers_convention():
    p = Problem(2, 16, 1024, 64)
    assert iomodel.attention_flops(p) == 4 * 2 * 16 * 1024**2 * 64
    assert iomodel.attention_flops(p, "backward") == 2.5 * 4 * 2 * 16 * 1024**2 * 64
    assert iomodel.attention_flops(p, "forward+backward") == 3.5 * 4 * 2 * 16 * 1024**2 * 64
    assert iomodel.attention_flops(Problem(2, 16, 1024, 64, causal=True)) == iomodel.attention_flops(p) / 2
    with pytest.raises(ValueError):
        iomodel.attention_flops(p, "sideways")


def test_paper_block_sizes():
    assert iomodel.paper_block_sizes(228 * 1024, 128, 2) == (128, 228)  # M = 116736 elements, M / 4d = 228
    assert iomodel.paper_block_sizes(16 * 1024, 64, 4) == (16, 16)
    with pytest.raises(ValueError):
        iomodel.paper_block_sizes(64, 128, 2)


def test_cli_prints_every_schedule(capsys):
    parser = argparse.ArgumentParser()
    iomodel.add_arguments(parser)
    assert iomodel.run(parser.parse_args(["--seq-len", "8192", "--head-dim", "128", "--sram-kib", "228"])) == 0
    out = capsys.readouterr().out
    for needle in (
        "standard (FA1 Alg. 0)",
        "key-major (FA1 Alg. 1)",
        "query-major (FA2)",
        "FA1 Alg. 4",
        "split dK/dV",
        "34.36 GFLOP",
    ):
        assert needle in out


def test_cli_rejects_bad_sizes_with_a_message(capsys):
    parser = argparse.ArgumentParser()
    iomodel.add_arguments(parser)
    assert iomodel.run(parser.parse_args(["--head-dim", "128", "--sram-kib", "0.1"])) == 2
    err = capsys.readouterr().err
    assert "argument --sram-kib: 0.1 KiB holds no tile at --head-dim 128 and --elem-bytes 2" in err
    assert "4 x 128 x 2 = 1024 bytes; use --sram-kib 1 or more" in err and err.count("\n") == 1


def _reported_tiles(out: str) -> list[tuple[int, int]]:
    """The ``Br x Bc`` column of the traffic table, for each tiled row, in the table's order."""
    rows = [line for line in out.splitlines() if line.startswith(("forward ", "backward "))]
    return [tuple(map(int, w.split("x"))) for row in rows for w in row.split() if re.fullmatch(r"\d+x\d+", w)]


@pytest.mark.parametrize(
    ("sram_kib", "d", "e", "blocks"),
    list(itertools.product([0.5, 1, 1.5, 3.3, 64, 100, 228], [64, 128], [2, 4], [(1, 1), (128, 64)])),
)
def test_the_command_shows_only_tiles_that_fit_m_or_names_the_budget_that_does(sram_kib, d, e, blocks, capsys):
    """A tile fits when its Q_i, O_i, K_j, V_j do (what FA1 Alg. 1 line 1 sizes): 2 (Br + Bc) d e <= M bytes.
    A refusal's budget is checked by running one byte below it (the same refusal) and at it (not that one)."""
    base = ["--seq-len", "1024", "--head-dim", str(d), "--elem-bytes", str(e)]
    base += ["--block-m", str(blocks[0]), "--block-n", str(blocks[1])]
    status, out, err = _main([*base, "--sram-kib", str(sram_kib)], capsys)
    if status == 0:
        tiles = _reported_tiles(out)
        assert len(tiles) == 4  # key-major forward, query-major, key-major backward, split
        assert all(2 * (br + bc) * d * e <= sram_kib * 1024 for br, bc in tiles), tiles
        paper = iomodel.paper_block_sizes(int(sram_kib * 1024), d, e)
        if 2 * sum(paper) * d * e <= sram_kib * 1024:
            assert tiles[0] == paper  # the paper's tile wherever it fits
        return
    assert (status, out) == (2, "") and err.startswith("flashattn-teach iomodel: error: argument --sram-kib:")
    found = re.search(r"= (\d+) bytes; use --sram-kib (\S+) or more", err)
    assert found is not None, err
    need, kib = int(found[1]), found[2]
    assert float(kib) * 1024 == need > sram_kib * 1024
    below = _main([*base, "--sram-kib", repr((need - 1) / 1024)], capsys)
    assert below[0] == 2 and found[0] in below[2]
    at = _main([*base, "--sram-kib", kib], capsys)
    assert at[0] == 0 or found[0] not in at[2]


# ------------------------------------------------------------------------------------------------- L2

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


# ----------------------------------------------------------------------------------------------- ring

HW = iomodel.RingHardware()  # 450 GB/s, 989 TFLOP/s x 0.5


@pytest.mark.parametrize("pass_", ["forward", "backward"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("H", "kv_heads", "d", "e"), [(1, None, 128, 2), (32, 8, 64, 2), (8, 1, 128, 4)])
def test_at_the_crossover_a_steps_transfer_takes_as_long_as_its_attention(pass_, causal, H, kv_heads, d, e):
    p = Problem(2, H, 1 << 16, d, elem_bytes=e, causal=causal)
    x = iomodel.crossover_n_local(p, HW, pass_, kv_heads)

    def comm_minus_compute(n: float) -> float:
        return (
            iomodel.step_bytes(p, n, pass_, kv_heads) / HW.bandwidth - iomodel.step_flops(p, n, pass_) / HW.throughput
        )

    scale = iomodel.step_flops(p, x, pass_) / HW.throughput
    assert abs(comm_minus_compute(x)) <= 1e-12 * scale
    assert comm_minus_compute(0.99 * x) > 0  # shorter shards: the transfer shows
    assert comm_minus_compute(1.01 * x) < 0  # longer: it hides


def test_crossover_values_by_hand():
    p = Problem(1, 1, 8192, 128)  # bf16, H_kv = H
    fwd = iomodel.crossover_n_local(p, HW)
    assert fwd == pytest.approx(989e12 * 0.5 / 450e9)  # t e / 4c = 1: N_local* = F / BW, about 1099 tokens
    assert iomodel.crossover_n_local(p, HW, "backward") == pytest.approx(0.8 * fwd)  # 4 / (4 x 2.5)
    assert iomodel.crossover_n_local(Problem(1, 1, 8192, 128, causal=True), HW) == pytest.approx(2 * fwd)
    assert iomodel.crossover_n_local(Problem(1, 32, 8192, 128), HW, kv_heads=8) == pytest.approx(fwd / 4)
    assert iomodel.crossover_n_local(Problem(1, 1, 8192, 64, elem_bytes=4), HW) == pytest.approx(2 * fwd)


def test_a_ring_step_by_hand():
    p = Problem(2, 4, 8192, 128, elem_bytes=2)
    step = iomodel.ring_step(p, 8, HW, "forward", kv_heads=2)
    assert step.n_local == 1024
    assert step.bytes == 2 * 1024 * 128 * 2 * 2 * 2  # K and V: N_local x d x e x H_kv x B
    assert step.flops == 4 * 2 * 4 * 1024**2 * 128
    assert step.comm_s == pytest.approx(step.bytes / 450e9)
    assert step.compute_s == pytest.approx(step.flops / 494.5e12)
    assert step.hides == (step.n_local >= step.crossover_n_local)
    bwd = iomodel.ring_step(p, 8, HW, "backward", kv_heads=2)
    assert (bwd.bytes, bwd.flops) == (2 * step.bytes, 2.5 * step.flops)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_the_ring_does_the_whole_attentions_flops(world, causal):
    p = Problem(2, 3, 4096, 64, causal=causal)
    step = iomodel.ring_step(p, world, HW)
    assert world * world * step.flops == iomodel.attention_flops(p)  # W devices x W steps


def _visible_pairs(q_pos: list[int], k_pos: list[int]) -> int:
    return sum(k <= q for q in q_pos for k in k_pos)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_gives_every_device_half_a_block_at_every_causal_step_and_contiguous_does_not(world):
    N = 2 * world * 6
    n_local, chunk = N // world, N // (2 * world)

    def zigzag(r: int) -> list[int]:
        return [*range(r * chunk, (r + 1) * chunk), *range((2 * world - 1 - r) * chunk, (2 * world - r) * chunk)]

    def contiguous(r: int) -> list[int]:
        return list(range(r * n_local, (r + 1) * n_local))

    for r in range(world):
        for s in range(world):
            pairs = _visible_pairs(zigzag(r), zigzag((r - s) % world))
            diagonal = n_local // 2 if s == 0 else 0  # the two triangles' diagonals
            assert pairs == n_local**2 // 2 + diagonal
    steps = {_visible_pairs(contiguous(r), contiguous((r - s) % world)) for r in range(world) for s in range(world)}
    assert 0 in steps and n_local**2 in steps  # contiguous: idle steps and full blocks


def test_ring_rejects_a_bad_split_or_bad_kv_heads():
    with pytest.raises(ValueError, match="at least 2 devices"):
        iomodel.shard_len(Problem(1, 1, 8192, 64), 1)
    with pytest.raises(ValueError, match="W = 3 devices"):
        iomodel.shard_len(Problem(1, 1, 8192, 64), 3)
    with pytest.raises(ValueError, match="2W = 16 zigzag chunks"):
        iomodel.shard_len(Problem(1, 1, 8200, 64, causal=True), 8)  # 8200 = 8 x 1025: fine non-causal only
    assert iomodel.shard_len(Problem(1, 1, 8200, 64), 8) == 1025
    with pytest.raises(ValueError, match="divide the 4 query heads"):
        iomodel.step_bytes(Problem(1, 4, 8192, 64), 1024, kv_heads=3)
    with pytest.raises(ValueError, match="pass_"):
        iomodel.step_flops(Problem(1, 4, 8192, 64), 1024, "sideways")
    with pytest.raises(ValueError, match="efficiency"):
        iomodel.RingHardware(efficiency=1.5)


# ------------------------------------------------------------------------------------------------ CLI


def _main(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        status = main(["iomodel", *argv])
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 1
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_cli_prints_the_roofline_the_l2_level_and_the_ring(capsys):
    status, out, err = _main(["--seq-len", "8192", "--head-dim", "128", "--sram-kib", "228", "--ring", "8"], capsys)
    assert (status, err) == (0, "")
    assert "ridge point 989 TFLOP/s / 4.8 TB/s = 206 FLOP/B" in out
    assert "L2 reuse: 50.0 MiB of L2, 132 programs" in out and "With L2 applies where every pass fits" in out
    table, l2_row = [line.split() for line in out.splitlines() if line.startswith("forward  query-major")]
    assert table[-2:] == ["126.0", "memory"]  # every load from HBM: memory-bound
    assert l2_row[5:7] == ["126.0", "memory"] and l2_row[-1] == "compute"  # with L2 reuse: compute-bound
    assert "Ring over W = 8 devices: N/W = 1024 tokens" in out
    (fwd,) = [line for line in out.splitlines() if line.startswith("forward") and "GFLOP" in line]
    assert fwd.split()[-3:] == ["no", "1099", "8792"]  # 1024 < N/W* = 1098.9
    assert "Ring over" not in _main([], capsys)[1]


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ("--ring 1", "--ring"),
        ("--ring 3", "--ring"),
        ("--ring 0", "--ring"),
        ("--causal --seq-len 8200 --ring 8", "--ring"),
        ("--heads 4 --kv-heads 3 --ring 2", "--kv-heads"),
        ("--heads 4 --kv-heads 8 --ring 2", "--kv-heads"),
        ("--efficiency 1.5 --ring 2", "--efficiency"),
        ("--efficiency 0", "--efficiency"),
        ("--l2-mib 0", "--l2-mib"),
        ("--l2-mib 1e307", "--l2-mib"),
        ("--l2-mib nan", "--l2-mib"),
        ("--programs 0", "--programs"),
        ("--link-gbs -1", "--link-gbs"),
        ("--peak-tflops inf", "--peak-tflops"),
        ("--hbm-tbs 0", "--hbm-tbs"),
    ],
)
def test_cli_rejects_bad_l2_roofline_and_ring_values_in_one_line(options, named, capsys):
    status, out, err = _main(options.split(), capsys)
    assert (status, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("flashattn-teach iomodel: error:") and f"argument {named}" in err


@pytest.mark.parametrize("option", ["--kv-heads 2", "--link-gbs 50", "--efficiency 0.7"])
def test_cli_refuses_a_ring_option_without_the_ring(option, capsys):
    status, out, err = _main(["--heads", "4", *option.split()], capsys)
    assert (status, out) == (2, "")
    assert f"argument {option.split()[0]}: describes the ring, needs --ring W (got {option})" in err
    status, out, err = _main(["--heads", "4", "--ring", "2", *option.split()], capsys)  # the negative control
    assert (status, err) == (0, "") and "Ring over W = 2 devices" in out


def test_cli_accepts_good_ring_values(capsys):
    """The negative control of the test above."""
    status, out, err = _main("--causal --seq-len 8192 --ring 4 --heads 8 --kv-heads 2 --efficiency 1".split(), capsys)
    assert (status, err) == (0, "") and "zigzag" in out and "H_kv = 2" in out
