"""The tiles the mask options let a tiled path skip: tiles outside a window, past a sequence's length or hidden
by the mask are never computed, tiles every row sees run unmasked, and no N x N tensor is held besides the
user's own mask."""

from __future__ import annotations

import pytest
import torch

from flashattn_teach._options import make_options
from flashattn_teach.masks.causal import TileKind
from flashattn_teach.reference import dense_attention, online_attention

from mask_cases import TILED, count_score_tiles


def needed_tiles(seen, block_m, block_n):
    """Independent count from the whole visibility matrix: (tiles some row sees, tiles every row sees)."""
    N_q, N_k = seen.shape[-2:]
    some = every = 0
    for r0 in range(0, N_q, block_m):
        for c0 in range(0, N_k, block_n):
            t = seen[..., r0 : r0 + block_m, c0 : c0 + block_n]
            some += bool(t.any())
            every += bool(t.all())
    return some, every


@pytest.mark.parametrize("attention", TILED)
@pytest.mark.parametrize(
    "window, causal_align", [((8, 0), "top_left"), ((3, 5), "bottom_right"), ((0, -1), "top_left")]
)
def test_window_tiles_outside_are_never_visited_and_inside_run_unmasked(attention, window, causal_align, monkeypatch):
    visited = count_score_tiles(monkeypatch)
    N_q, N_k, block_m, block_n = 40, 50, 4, 6
    q, k, v = (torch.randn(1, 1, n, 4) for n in (N_q, N_k, N_k))
    attention(q, k, v, window=window, causal_align=causal_align, block_m=block_m, block_n=block_n)
    i, j = torch.arange(N_q)[:, None], torch.arange(N_k)[None, :]
    off = 0 if causal_align == "top_left" else N_k - N_q
    left, right = window
    seen = (j >= i + off - left) if left >= 0 else torch.ones(N_q, N_k, dtype=torch.bool)
    if right >= 0:
        seen &= j <= i + off + right
    some, every = needed_tiles(seen, block_m, block_n)
    assert len(visited) == some
    assert sum(not masked for _, _, masked in visited) == every


def test_a_window_visits_scores_linear_in_n(monkeypatch):
    """Window w: O(N (w + Bc)) scores; doubling N doubles them (the full matrix would quadruple)."""
    visited = count_score_tiles(monkeypatch)
    scores = []
    for N in (256, 512):
        visited.clear()
        q = torch.randn(1, 1, N, 4)
        online_attention(q, q, q, window=(16, 0), block_m=16, block_n=16)
        scores.append(sum(br * bc for br, bc, _ in visited))
    # Each query block of 16 rows sees its own key block and the one before: 2 tiles (1 for the first).
    assert scores == [(2 * N // 16 - 1) * 16 * 16 for N in (256, 512)]
    assert scores[1] < 2.1 * scores[0]  # and the whole matrix would be 256^2 = 65536, then 4x that


def test_padding_and_a_mask_skip_the_tiles_nobody_sees(monkeypatch):
    visited = count_score_tiles(monkeypatch)
    N, block = 32, 8
    q, k, v = (torch.randn(2, 2, N, 4) for _ in range(3))
    mask = torch.ones(2, 1, N, N, dtype=torch.bool)
    mask[:, :, :, 16:] = False  # key blocks 2 and 3 hidden from every row
    mask[:, :, 8:16, :8] = False  # and tile (1, 0)
    online_attention(q, k, v, seqlens_k=torch.tensor([30, 12]), attn_mask=mask, block_m=block, block_n=block)
    # Key blocks 0 and 1 for every query block, less tile (1, 0); key block 1 is partial under seqlens 12.
    assert len(visited) == 4 * 2 - 1
    # Key block 1 carries a mask in all four query blocks (batch 1 sees keys 8-11 of it); key block 0 none.
    assert sum(masked for _, _, masked in visited) == 4


def test_tile_kinds_per_batch_element_and_head():
    q = torch.randn(2, 2, 16, 4)
    mask = torch.ones(2, 2, 16, 16, dtype=torch.bool)
    mask[1, 0, :, :8] = False  # batch 1, head 0 sees nothing of key block 0
    opts = make_options(q, q, q, seqlens_k=torch.tensor([16, 4]), attn_mask=mask)
    tiling = opts.mask.tiling(8, 8)
    assert tiling.kind(0, 1, b=0, h=0) is TileKind.FULL
    assert tiling.kind(0, 1, b=1, h=1) is TileKind.SKIP  # past batch 1's 4 keys
    assert tiling.kind(0, 0, b=1, h=1) is TileKind.PARTIAL  # keys 0-3 of 8
    assert tiling.kind(0, 0, b=1, h=0) is TileKind.SKIP  # hidden by the mask
    assert tiling.kind(0, 1) is TileKind.PARTIAL  # over the whole batch: some see all of it, some none


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest tensor any torch op allocates (views of an op's inputs are not allocations)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        storages = {a.untyped_storage().data_ptr() for a in inputs}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in storages:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("option", ["attn_mask", "window", "seqlens_k", "alibi_slopes"])
def test_no_n_by_n_tensor_besides_the_users_mask(option):
    N, block = 256, 32
    q, k, v = (torch.randn(1, 1, N, 4) for _ in range(3))
    mask = torch.rand(1, 1, N, N) > 0.5
    value = {
        "attn_mask": mask,
        "window": (16, 16),
        "seqlens_k": torch.tensor([200]),
        "alibi_slopes": torch.tensor([0.5]),
    }[option]
    with LargestTensor() as probe:
        online_attention(q, k, v, **{option: value}, block_m=block, block_n=block)
    assert probe.largest <= N * block  # a key block's column of the mask at most; the score tile is smaller
    with LargestTensor() as probe:
        dense_attention(q, k, v, **{option: value})
    assert probe.largest >= N * N  # the probe sees the dense oracle's score matrix
