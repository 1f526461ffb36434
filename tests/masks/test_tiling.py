"""What the tiled references hold and compute: bounded score tiles, causal tiles skipped not masked."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashattn_teach.masks.causal import causal_mask
from flashattn_teach.reference import dense_attention, key_major_attention, online_attention, scores

from probes import patch_everywhere

TILED = [pytest.param(online_attention, id="query_major"), pytest.param(key_major_attention, id="key_major")]


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any torch op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("attention", TILED)
def test_never_holds_more_than_one_score_tile_per_head(attention):
    B, H, N, D = 2, 3, 96, 2
    block_m, block_n = 8, 16
    q, k, v = (torch.randn(B, H, N, D) for _ in range(3))
    with LargestTensor() as mode:
        attention(q, k, v, block_m=block_m, block_n=block_n)
    assert mode.largest <= max(B * H * block_m * block_n, B * H * N * D)
    with LargestTensor() as mode:
        dense_attention(q, k, v)
    assert mode.largest >= B * H * N * N  # the same probe sees the dense oracle's score matrix


@pytest.mark.parametrize("attention", TILED)
@pytest.mark.parametrize(
    "N_q, N_k, causal_align",
    [(23, 23, "top_left"), (9, 20, "bottom_right"), (20, 9, "bottom_right"), (20, 9, "top_left")],
)
@pytest.mark.parametrize("block_m, block_n", [(4, 4), (3, 5), (8, 2)])
def test_causal_tiles_above_the_diagonal_are_never_computed(
    attention, N_q, N_k, causal_align, block_m, block_n, monkeypatch
):
    visited = []
    original = scores.score_tile

    def counting_score_tile(q_i, k_j, scale, allowed=None, **variants):
        visited.append((q_i.shape[-2], k_j.shape[-2]))
        return original(q_i, k_j, scale, allowed, **variants)

    patch_everywhere(monkeypatch, scores, "score_tile", counting_score_tile)
    q, k, v = (torch.randn(1, 1, n, 4) for n in (N_q, N_k, N_k))
    attention(q, k, v, causal=True, causal_align=causal_align, block_m=block_m, block_n=block_n)

    # Independent count: a tile is needed iff some query row of it sees some key column of it.
    mask = causal_mask(N_q, N_k, causal_align)
    needed = sum(
        bool(mask[r0 : r0 + block_m, c0 : c0 + block_n].any())
        for r0 in range(0, N_q, block_m)
        for c0 in range(0, N_k, block_n)
    )
    assert len(visited) == needed
