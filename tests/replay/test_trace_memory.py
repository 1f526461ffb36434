"""Memory step by step (trace/memory.py): the HBM bytes of the replayed schedule against iomodel's closed forms,
against a tile-by-tile walk written here, and the teaching example's figures worked out by hand."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from flashattn_teach.replay import replay
from flashattn_teach.replay.memory import closed_form, memory_figure, memory_json, traffic_through
from flashattn_teach.tools.iomodel import (
    STAT_BYTES,
    Problem,
    key_major_forward_io,
    query_major_forward_io,
    standard_forward_io,
)

IOMODEL = {"query_major": query_major_forward_io, "key_major": key_major_forward_io}


def qkv(n_q: int, n_k: int, d: int, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g, dtype=dtype) for n in (n_q, n_k, n_k))


def tile_walk(r, eb: int) -> tuple[list[tuple[dict, dict]], tuple[dict, dict]]:
    """The oracle: the papers' loops run tile by tile over ``r.schedule``, counting loads and stores as they
    happen; the non-zero ``(reads, writes)`` after each position, and at the end."""
    rows, cols = r.steps.tiling.row_blocks, r.steps.tiling.col_blocks
    D, D_v = r.steps.q_i.shape[-1], r.steps.v.shape[-1]
    reads: Counter[str] = Counter()
    writes: Counter[str] = Counter()
    size = {"l": STAT_BYTES, "m": STAT_BYTES, "lse": STAT_BYTES}
    after: list[tuple[dict, dict]] = []

    def add(counter, name, n):
        counter[name] += n * size.get(name, eb)

    def snapshot():
        return {k: v for k, v in reads.items() if v}, {k: v for k, v in writes.items() if v}

    if r.order == "query_major":  # FA2 Alg. 1
        for i in range(r.T_r):
            js, br = list(r.schedule.key_blocks(i)), rows[i][1] - rows[i][0]
            for n, j in enumerate(js):
                if n == 0:
                    add(reads, "Q", br * D)
                add(reads, "K", (cols[j][1] - cols[j][0]) * D)
                add(reads, "V", (cols[j][1] - cols[j][0]) * D_v)
                if n == len(js) - 1:
                    add(writes, "O", br * D_v)
                    add(writes, "lse", br)
                after.append(snapshot())
            if not js:  # FA2's kernel with an empty key range: O_i = 0 and lse_i written, nothing read
                add(writes, "O", br * D_v)
                add(writes, "lse", br)
    else:  # FA1 Alg. 1
        add(writes, "O", r.N_q * D_v)
        add(writes, "l", r.N_q)
        add(writes, "m", r.N_q)
        for j in range(r.T_c):
            for n, i in enumerate(r.schedule.query_blocks(j)):
                bc, br = cols[j][1] - cols[j][0], rows[i][1] - rows[i][0]
                if n == 0:
                    add(reads, "K", bc * D)
                    add(reads, "V", bc * D_v)
                for name, elements in (("Q", br * D), ("O", br * D_v), ("l", br), ("m", br)):
                    add(reads, name, elements)
                for name, elements in (("O", br * D_v), ("l", br), ("m", br)):
                    add(writes, name, elements)
                after.append(snapshot())
    return after, snapshot()


def nonzero(t) -> tuple[dict, dict]:
    return {k: v for k, v in t.reads.items() if v}, {k: v for k, v in t.writes.items() if v}


SHAPES = [(1, 1, 1, 1), (5, 4, 2, 2), (6, 4, 2, 2), (7, 3, 3, 2), (7, 8, 2, 3), (13, 2, 4, 5), (16, 4, 16, 16)]


@pytest.mark.parametrize("order", ["query_major", "key_major"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n", "d", "block_m", "block_n"), SHAPES)
def test_schedule_total_equals_iomodel_closed_form(order, causal, n, d, block_m, block_n):
    for dtype, eb in ((torch.float64, 8), (torch.float32, 4)):
        r = replay(*qkv(n, n, d, dtype), block_m=block_m, block_n=block_n, causal=causal, order=order)
        want = IOMODEL[order](Problem(1, 1, n, d, elem_bytes=eb, causal=causal), block_m, block_n)
        assert traffic_through(r) == want
        assert closed_form(r) == want
        assert traffic_through(r, len(r.schedule) - 1) == want  # the last tile ends the schedule's traffic
        assert traffic_through(r, elem_bytes=2) == IOMODEL[order](
            Problem(1, 1, n, d, elem_bytes=2, causal=causal), block_m, block_n
        )


def test_closed_form_check_can_fail():
    """Negative control: swapped tile sizes give other totals, and the comparison sees it."""
    r = replay(*qkv(7, 7, 4), block_m=3, block_n=2, causal=True)
    p = Problem(1, 1, 7, 4, elem_bytes=8, causal=True)
    assert traffic_through(r) == query_major_forward_io(p, 3, 2)
    assert traffic_through(r) != query_major_forward_io(p, 2, 3)
    assert traffic_through(r) != query_major_forward_io(Problem(1, 1, 7, 4, elem_bytes=8), 3, 2)


CASES = [
    dict(n_q=7, n_k=7, block_m=3, block_n=2, causal=True),
    dict(n_q=8, n_k=8, block_m=2, block_n=2, window=(2, 0)),
    dict(n_q=8, n_k=8, block_m=3, block_n=2, window=(1, 1)),
    dict(n_q=6, n_k=6, block_m=2, block_n=2, seqlens_k=torch.tensor([3])),
    dict(n_q=6, n_k=4, block_m=2, block_n=2, causal=True, causal_align="bottom_right"),  # block 0 sees no key
    dict(n_q=5, n_k=9, block_m=2, block_n=4),
    dict(n_q=6, n_k=6, block_m=2, block_n=2, attn_mask=torch.tensor([[1, 1, 0, 0, 1, 1]] * 6, dtype=torch.bool)),
]


@pytest.mark.parametrize("order", ["query_major", "key_major"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}" for k in c if k not in ("n_q", "n_k")))
def test_traffic_after_every_tile_matches_a_tile_by_tile_walk(order, case):
    case = dict(case)
    n_q, n_k = case.pop("n_q"), case.pop("n_k")
    r = replay(*qkv(n_q, n_k, 3), order=order, **case)
    after, end = tile_walk(r, 8)
    assert len(after) == len(r.schedule)
    previous = None
    for p, want in enumerate(after):
        got = traffic_through(r, p)
        assert nonzero(got) == want, p
        if previous is not None:  # monotone: bytes only add up
            assert all(got.reads[k] >= previous.reads[k] for k in got.reads)
            assert all(got.writes[k] >= previous.writes[k] for k in got.writes)
        previous = got
    assert nonzero(traffic_through(r)) == end
    for i in range(r.T_r):  # the figure walks once for all of a block's steps: the same counts
        figure = memory_figure(r.with_options(query_block=i))
        assert [nonzero(s.hbm) for s in figure.steps] == [after[s.position] for s in figure.steps]
        assert nonzero(figure.total) == end
    tile_masks = set(r.variants) - {"softcap", "alibi_slopes"}
    assert (closed_form(r) is None) == (bool(tile_masks) or n_q != n_k)


def test_skipped_tiles_are_not_loaded():
    r = replay(*qkv(8, 8, 4), block_m=2, block_n=2, causal=True)
    plain = replay(*qkv(8, 8, 4), block_m=2, block_n=2)
    # causal: block i reads key blocks 0..i, 1 + 2 + 3 + 4 = 10 of the plain 16 tiles' K_j
    assert traffic_through(r).reads["K"] == 10 * 2 * 4 * 8
    assert traffic_through(plain).reads["K"] == 16 * 2 * 4 * 8
    assert len(r.skipped) == 6


def test_on_chip_buffers_and_sizes_ragged_tiles():
    r = replay(*qkv(7, 7, 4, torch.float32), block_m=3, block_n=2, query_block=2)  # rows 6-6, last cols 6-6
    figure = memory_figure(r)
    assert figure.elem_bytes == 4
    assert [s.position for s in figure.steps] == [r.schedule.index((2, j)) for j in range(4)]
    last = figure.steps[-1]
    assert [(b.name, b.shape, b.bytes) for b in last.on_chip] == [
        ("Q_i", (1, 4), 16),
        ("K_j", (1, 4), 16),
        ("V_j", (1, 4), 16),
        ("S_ij / P_ij", (1, 1), 4),
        ("acc", (1, 4), 16),
        ("m_i", (1,), 4),
        ("l_i", (1,), 4),
    ]
    assert last.on_chip_bytes == 76
    assert figure.steps[0].on_chip[1].shape == (2, 4)


def test_elem_bytes_default_is_the_given_dtype():
    r16 = replay(*qkv(6, 6, 4, torch.float16), block_m=2, block_n=2)  # computed in float32, stored as float16
    assert memory_figure(r16).elem_bytes == 2
    assert memory_figure(r16).steps[0].on_chip[3].elem_bytes == 4  # S_ij, acc: fp32 accumulators
    assert memory_figure(r16, elem_bytes=1).elem_bytes == 1
    with pytest.raises(ValueError, match="elem_bytes"):
        memory_figure(r16, elem_bytes=0)


def test_dense_path_is_iomodels_standard_forward_and_rectangular_by_its_rule():
    r = replay(*qkv(6, 6, 4), block_m=2, block_n=2)
    assert memory_figure(r).dense == standard_forward_io(Problem(1, 1, 6, 4, elem_bytes=8))
    rect = memory_figure(replay(*qkv(5, 9, 4), block_m=2, block_n=4))
    assert rect.dense.reads == {"Q": 160, "K": 288, "S": 360, "P": 360, "V": 288}
    assert rect.dense.writes == {"S": 360, "P": 360, "O": 160}
    assert rect.closed_form is None


def test_teaching_example_figures():
    """N = 6, D = 4, 2 x 2 tiles, float64 (8 bytes): worked out by hand."""
    q, k, v = qkv(6, 6, 4)
    r = replay(q, k, v, block_m=2, block_n=2)
    f = memory_figure(r)
    assert f.schedule_length == 9 and [s.position for s in f.steps] == [0, 1, 2]
    assert all(s.on_chip_bytes == 64 * 4 + 32 + 8 + 8 for s in f.steps)  # Q_i K_j V_j acc, S_ij, m_i, l_i
    # block 0, first tile: Q_0, K_0, V_0 read (2 x 4 x 8 = 64 B each); nothing written yet
    assert f.steps[0].hbm.reads == {"Q": 64, "K": 64, "V": 64} and f.steps[0].hbm.write_bytes == 0
    # last tile of block 0: K and V read in full once; O_0 (64 B) and lse_0 (2 x 4 B) written
    assert f.steps[2].hbm.reads == {"Q": 64, "K": 192, "V": 192}
    assert f.steps[2].hbm.writes == {"O": 64, "lse": 8}
    # the whole schedule: Q once (192), K and V once per query block (3 x 192), O once, lse: 1560 B
    assert f.total.reads == {"Q": 192, "K": 576, "V": 576} and f.total.writes == {"O": 192, "lse": 24}
    assert f.total.total_bytes == 1560
    # standard attention: 4 N d + 4 N^2 = 96 + 144 elements of 8 B: 1920 B; S and P alone 1152 B
    assert f.dense.total_bytes == 1920
    # key-major: K, V once (384); per tile (9) Q_i, O_i read and O_i written (3 x 64), l_i, m_i read and
    # written (4 x 8); O, l, m initialised (192 + 2 x 24): 384 + 9 x 224 + 240 = 2640 B
    km = memory_figure(r.with_options(order="key_major"))
    assert km.total.total_bytes == 2640 and km.closed_form == km.total
    assert km.steps[0].hbm.writes == {"O": 192 + 64, "l": 24 + 8, "m": 24 + 8}  # line 2's init, then tile (0, 0)


def test_memory_json_is_strict_json_of_the_figure():
    r = replay(*qkv(7, 7, 4), block_m=3, block_n=2, causal=True, order="key_major", query_block=1)
    data = memory_json(r)
    assert json.loads(json.dumps(data, allow_nan=False)) == data
    f = memory_figure(r)
    assert [s["position"] for s in data["steps"]] == [s.position + 1 for s in f.steps]
    assert [s["hbm"]["reads"] for s in data["steps"]] == [s.hbm.reads for s in f.steps]
    assert data["total"]["read"] == f.total.read_bytes and data["closedForm"]["written"] == f.total.write_bytes
    assert data["dense"]["reads"] == f.dense.reads


def test_table_shows_the_memory_of_every_update():
    import io

    from flashattn_teach.replay.table import render_table

    r = replay(*qkv(6, 6, 4), block_m=2, block_n=2)
    out = io.StringIO()
    render_table(r, out, width=140)
    text = out.getvalue()
    assert text.count("whole schedule 1560 B (iomodel's closed form: 1560 B)") == 3
    assert [line.split()[2] for line in text.splitlines() if line.startswith("│ total ")] == ["304"] * 3
    all_rows = [line.split() for line in text.splitlines() if " all " in line]
    read_so_far = [int(row[row.index("all") + 2]) for row in all_rows]  # all, bar, bytes read so far
    assert read_so_far == [s.hbm.read_bytes for s in memory_figure(r).steps]  # 192, 320, 448
