"""The layouts, the ring's schedule and its picture, in one process (no process group needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashattn_teach.distributed import chunk_ids, picture, ring_schedule, shard, unshard, visited_tiles
from flashattn_teach.distributed.layout import pair_kind
from flashattn_teach.errors import AttentionValueError
from flashattn_teach.masks.causal import TileKind


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_unshard_inverts_shard(layout, world_size):
    x = torch.arange(2 * 3 * 24 * 2).reshape(2, 3, 24, 2)
    shards = [shard(x, world_size, r, layout) for r in range(world_size)]
    assert torch.equal(unshard(shards, layout), x)
    positions = torch.cat([shard(torch.arange(24), world_size, r, layout, dim=0) for r in range(world_size)])
    assert sorted(positions.tolist()) == list(range(24))  # each position on exactly one rank


def test_zigzag_rank_holds_an_early_and_a_late_chunk():
    assert [chunk_ids(4, r, "zigzag") for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert shard(torch.arange(16), 4, 1, "zigzag", dim=0).tolist() == [2, 3, 12, 13]


def test_shard_refuses_a_sequence_the_layout_does_not_divide():
    with pytest.raises(AttentionValueError, match=r"x has 12 positions .* multiple of 8"):
        shard(torch.zeros(1, 1, 12, 4), 4, 0, "zigzag")
    with pytest.raises(AttentionValueError, match="layout must be one of"):
        shard(torch.zeros(1, 1, 12, 4), 4, 0, "striped")


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_schedule_visits_every_visible_chunk_pair_exactly_once(layout, causal):
    W = 4
    seen: list[tuple[int, int]] = []
    for rank in range(W):
        q_ids = chunk_ids(W, rank, layout)
        for step, calls in enumerate(ring_schedule(W, rank, layout, causal)):
            for call in calls:
                assert call.step == step and call.source == (rank - step) % W
                k_ids = chunk_ids(W, call.source, layout)
                pairs = [(q_ids[a], k_ids[b]) for a in call.q_chunks for b in call.k_chunks]
                seen += [p for p in pairs if pair_kind(*p, causal) is not TileKind.SKIP]
    n = 2 * W if layout == "zigzag" else W
    assert sorted(seen) == [(a, b) for a in range(n) for b in range(n) if not causal or b <= a]


def test_visited_tiles_balanced_by_zigzag_only_under_causal():
    assert visited_tiles(64, 4, "zigzag", True, 4, 4) == [34] * 4
    assert visited_tiles(64, 4, "contiguous", True, 4, 4) == [10, 26, 42, 58]
    assert visited_tiles(64, 4, "contiguous", False, 4, 4) == [64] * 4
    assert sum(visited_tiles(64, 4, "zigzag", True, 4, 4)) == sum(visited_tiles(64, 4, "contiguous", True, 4, 4))


def test_picture_fits_80_columns_and_shows_the_balance():
    for W in range(1, 9):
        for layout in ("contiguous", "zigzag"):
            assert max(len(line) for line in picture(W, layout).splitlines()) <= 80
    text = picture(4, "zigzag")
    assert "    7  (0)    0 0 0 0 0 0 0 0    0 3 2 1 1 2 3 0" in text
    assert text.endswith("work per rank, in blocks of N/W x N/W scores:\n0: 2  1: 2  2: 2  3: 2")
    assert picture(4, "contiguous").endswith(
        "work per rank, in blocks of N/W x N/W scores:\n0: 0.5  1: 1.5  2: 2.5  3: 3.5"
    )


def test_the_docs_show_the_picture_the_code_draws():
    readme = (Path(__file__).resolve().parents[2] / "docs" / "ring-attention.md").read_text()
    assert picture(4, "zigzag") in readme
    assert "the same work per rank is `" + picture(4, "contiguous").splitlines()[-1] + "`" in readme
