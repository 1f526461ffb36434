"""``explain_with_kvcache`` for a paged call: the page walk names the pages each key range reads, says
whether they are a view or gathered (checked against the storage the read actually uses), and writes
nothing."""

from __future__ import annotations

import torch

import flashattn_teach as fa
from flashattn_teach.serving.pages import element_caches


def test_page_walk_names_each_ranges_pages_and_writes_nothing():
    q = torch.randn(2, 4, 1, 8)
    pool = torch.randn(10, 16, 2, 8).transpose(1, 2)  # flash-attn's layout: page_size 16, H_kv 2
    before = pool.clone()
    table = torch.tensor([[3, 4, 5, 9], [7, 1, 0, 0]], dtype=torch.int32)
    k = v = torch.randn(2, 2, 1, 8)
    plan = fa.explain_with_kvcache(
        q,
        pool,
        pool,
        k,
        v,
        cache_seqlens=torch.tensor([39, 19]),
        block_table=table,
        num_splits=2,
        cache_leftpad=torch.tensor([0, 3], dtype=torch.int32),
        sinks=torch.zeros(4),
    )
    # L = [40, 20]; element 1's keys start at its padding, 3: ranges [3, 12) and [12, 20)
    walk = "b=0: [0, 20) pages 3 4 (view), [20, 40) pages 4 5 (view); b=1: [3, 12) pages 7 (view), [12, 20) pages 7 1"
    assert walk + " (gathered)" in plan.reason
    assert "page_size 16, N_max = 64" in plan.reason and "sinks merged once per row" in plan.reason
    assert torch.equal(pool, before)
    caches = element_caches(pool, pool, table)
    ptr = pool.untyped_storage().data_ptr()
    for b, s0, s1, view in [(0, 0, 20, True), (0, 20, 40, True), (1, 3, 12, True), (1, 12, 20, False)]:
        assert caches[b].reads_a_view(s0, s1) is view
        assert (caches[b].read(s0, s1)[0].untyped_storage().data_ptr() == ptr) is view
