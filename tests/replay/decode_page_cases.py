"""Decode steps for the decode page's tests: a contiguous cache with a sink, a paged cache, and a window that
leaves some rows without a key in some splits (``lse_s = -inf``). float64 throughout."""

from __future__ import annotations

import torch

from flashattn_teach.replay import DecodeReplay, replay_decode


def _inputs(seed: int, *, B: int, N_new: int, N_max: int, new_kv: int, D: int = 4) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, N_new, D, generator=g, dtype=torch.float64)
    k_cache, v_cache = (torch.randn(B, 1, N_max, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, 1, new_kv, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k_cache, v_cache, k, v


def sink_step() -> DecodeReplay:
    """5 cached + 2 new keys, 2 causal queries, 3 splits of BLOCK_N=2, the head's sink 0.5 merged in last."""
    q, k_cache, v_cache, k, v = _inputs(0, B=1, N_new=2, N_max=9, new_kv=2)
    sinks = torch.tensor([0.5], dtype=torch.float64)
    return replay_decode(q, k_cache, v_cache, k, v, cache_seqlens=5, block_n=2, num_splits=3, causal=True, sinks=sinks)


PAGE_SIZE = 3
BLOCK_TABLE = torch.tensor([[6, 2, 7, 0], [1, 5, 3, 4]], dtype=torch.int32)  # (B, max_blocks)


def paged_step() -> DecodeReplay:
    """Element 1 of a paged cache (pages of 3 slots, block ids 1, 5, 3 for its keys 0-8), 7 cached + 2 new
    keys, causal."""
    B, max_blocks = BLOCK_TABLE.shape
    N_max = PAGE_SIZE * max_blocks
    q, k_cache, v_cache, k, v = _inputs(4, B=B, N_new=2, N_max=N_max, new_kv=2)
    k_pool = torch.zeros(8, 1, PAGE_SIZE, 4, dtype=torch.float64)
    v_pool = torch.zeros_like(k_pool)
    for b in range(B):
        for p in range(max_blocks):  # page p of element b holds its keys [3 p, 3 p + 3)
            k_pool[BLOCK_TABLE[b, p]] = k_cache[b, :, p * PAGE_SIZE : (p + 1) * PAGE_SIZE]
            v_pool[BLOCK_TABLE[b, p]] = v_cache[b, :, p * PAGE_SIZE : (p + 1) * PAGE_SIZE]
    lengths = torch.tensor([4, 7])
    return replay_decode(
        q,
        k_pool,
        v_pool,
        k,
        v,
        cache_seqlens=lengths,
        block_n=2,
        num_splits=2,
        batch_index=1,
        causal=True,
        block_table=BLOCK_TABLE,
    )


def window_step() -> DecodeReplay:
    """A window of one key (the diagonal): each of the 2 rows sees one key, so each split leaves a row at -inf."""
    q, k_cache, v_cache, k, v = _inputs(2, B=1, N_new=2, N_max=8, new_kv=1)
    return replay_decode(q, k_cache, v_cache, k, v, cache_seqlens=5, block_n=1, num_splits=2, window=(0, 0))
