"""The schedule without a tile list, against the tile list built cell by cell; the layering of trace/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flashattn_teach._options import make_options
from flashattn_teach.replay.schedule import ORDERS, Schedule, visited_key_blocks


@st.composite
def grids(draw):
    N_q, N_k = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    return {
        "N_q": N_q,
        "N_k": N_k,
        "block_m": draw(st.integers(1, 12)),
        "block_n": draw(st.integers(1, 12)),
        "causal": draw(st.booleans()),
        "causal_align": draw(st.sampled_from(["top_left", "bottom_right"])),
        "window": (draw(st.integers(-1, 8)), draw(st.integers(-1, 8))),
        "seqlen": draw(st.none() | st.integers(0, N_k)),
        "order": draw(st.sampled_from(ORDERS)),
    }


def tiling_of(g, attn_mask=None):
    """The references' tiling of one (batch element, head) with these options."""
    q, k = torch.zeros(1, 1, g["N_q"], 1), torch.zeros(1, 1, g["N_k"], 1)
    seqlens_k = None if g["seqlen"] is None else torch.tensor([g["seqlen"]])
    opts = make_options(
        q,
        k,
        k,
        causal=g["causal"],
        causal_align=g["causal_align"],
        window=g["window"],
        seqlens_k=seqlens_k,
        attn_mask=attn_mask,
    )
    return opts.mask.tiling(g["block_m"], g["block_n"])


def schedule_of(g, attn_mask=None) -> Schedule:
    tiling = tiling_of(g, attn_mask)
    return Schedule(visited_key_blocks(tiling, b=0), len(tiling.col_blocks), order=g["order"])


def cell_visible(g, r: int, c: int) -> bool:
    """masks.py's rule, cell by cell: causal, window (left, right) around the diagonal, the key length
    (bottom-right: the diagonal of the batch element's own length, as flash-attn's)."""
    length = g["N_k"] if g["seqlen"] is None else g["seqlen"]
    offset = 0 if g["causal_align"] == "top_left" else length - g["N_q"]
    left, right = g["window"]
    right = 0 if g["causal"] else right
    return (
        (left < 0 or c >= r + offset - left)
        and (right < 0 or c <= r + offset + right)
        and (g["seqlen"] is None or c < g["seqlen"])
    )


def tile_list(g) -> list[tuple[int, int]]:
    """Every tile holding a visible cell, in loop order."""
    bm, bn = g["block_m"], g["block_n"]
    tiles = [
        (i, j)
        for i in range(-(-g["N_q"] // bm))
        for j in range(-(-g["N_k"] // bn))
        if any(
            cell_visible(g, r, c)
            for r in range(i * bm, min((i + 1) * bm, g["N_q"]))
            for c in range(j * bn, min((j + 1) * bn, g["N_k"]))
        )
    ]
    return tiles if g["order"] == "query_major" else sorted(tiles, key=lambda t: (t[1], t[0]))


@given(grids())
def test_schedule_behaves_as_the_tuple_of_its_tiles_for_any_grid(g):
    s = schedule_of(g)
    tiles = tile_list(g)
    tiling = tiling_of(g)
    assert [list(s.key_blocks(i)) for i in range(s.T_r)] == [tiling.key_blocks(i, b=0, h=0) for i in range(s.T_r)]
    assert all(isinstance(s.key_blocks(i), range) for i in range(s.T_r))  # O(T_r) memory without a mask
    assert list(s) == tiles and len(s) == len(tiles)
    assert [s[p] for p in range(len(tiles))] == tiles
    assert [s[-p] for p in range(1, len(tiles) + 1)] == [tiles[-p] for p in range(1, len(tiles) + 1)]
    with pytest.raises(IndexError):
        s[len(tiles)]
    grid = [(i, j) for i in range(s.T_r) for j in range(s.T_c)]
    for tile in grid:
        assert (tile in s) == (tile in tiles)
        if tile in tiles:
            assert s.index(tile) == tiles.index(tile)
        else:
            with pytest.raises(ValueError, match="not computed"):
                s.index(tile)
    assert list(s.skipped()) == [t for t in grid if t not in tiles]  # row by row
    assert len(s.skipped()) == len(grid) - len(tiles)
    assert all((t in s.skipped()) == (t not in tiles) for t in grid)


@given(grids(), st.data())
def test_done_holds_exactly_the_tiles_before_a_position(g, data):
    s = schedule_of(g)
    tiles = tile_list(g)
    position = data.draw(st.integers(0, len(tiles)))
    done = s.before(position)
    assert list(done) == tiles[:position] and len(done) == position
    for i in range(s.T_r + 1):  # one row and one column past the grid: never done
        for j in range(s.T_c + 1):
            assert ((i, j) in done) == ((i, j) in tiles[:position])


@given(grids(), st.data())
def test_a_masked_schedule_visits_what_the_tiling_visits_in_both_orders(g, data):
    bits = data.draw(st.lists(st.booleans(), min_size=g["N_q"] * g["N_k"], max_size=g["N_q"] * g["N_k"]))
    mask = torch.tensor(bits).reshape(g["N_q"], g["N_k"])
    s, tiling = schedule_of(g, mask), tiling_of(g, mask)
    rule = [(i, j) for i in range(s.T_r) for j in tiling.key_blocks(i, b=0, h=0)]
    assert sorted(s) == rule and len(s) == len(rule)
    assert [s.index(t) for t in s] == list(range(len(s)))
    assert list(s.skipped()) == [(i, j) for i in range(s.T_r) for j in range(s.T_c) if (i, j) not in rule]
    # Every tile with a cell visible under both the structure and the mask is visited.
    bm, bn = g["block_m"], g["block_n"]
    for r in range(g["N_q"]):
        for c in range(g["N_k"]):
            if cell_visible(g, r, c) and mask[r, c]:
                assert (r // bm, c // bn) in s


def test_objects_that_are_not_tiles_are_in_nothing():
    g = {"N_q": 4, "N_k": 4, "block_m": 2, "block_n": 2, "causal": False, "causal_align": "top_left"}
    s = schedule_of({**g, "window": (-1, -1), "seqlen": None, "order": "query_major"})
    for thing in [(0,), (0, 0, 0), "ab", (0.0, 0), None]:
        assert thing not in s and thing not in s.before(len(s)) and thing not in s.skipped()


def test_trace_modules_import_each_other_without_a_cycle():
    """Layering: each module of trace/ imports only modules below it (replay -> manifest -> html, ...)."""
    package = Path(__file__).resolve().parents[2] / "src" / "flashattn_teach" / "replay"
    graph = {}
    for path in package.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                imported |= {node.module} if node.module else {a.name for a in node.names}
        graph[path.stem] = imported & {p.stem for p in package.glob("*.py")}
    assert graph["manifest"] >= {"replay"} and graph["replay"] >= {"schedule"}  # the probe sees imports

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, f"import cycle: {' -> '.join((*path, node))}"
        for nxt in graph[node]:
            visit(nxt, (*path, node))

    for module in graph:
        visit(module, ())
