"""The IO model against independent counts: tiled schedules run in numpy through a counting "HBM", and the
traffic's scaling with N, d and the SRAM size."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from flashattn_teach.tools import iomodel
from flashattn_teach.tools.iomodel import Problem

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
