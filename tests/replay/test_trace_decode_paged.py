"""The decode replay of a paged cache: the same replay as the contiguous cache holding the same keys, the
pages recorded per key, the pool untouched, and the terminal table, the JSON and the PNG showing each key's
page."""

from __future__ import annotations

import io

import pytest
import torch

from flashattn_teach.replay import replay_decode
from flashattn_teach.replay.manifest import decode_to_experiment, schema
from flashattn_teach.replay.png.decode import render_decode_png, slot_label
from flashattn_teach.replay.table import render_table


def test_paged_replay_is_the_contiguous_replay_with_its_pages(tmp_path):
    g = torch.Generator().manual_seed(4)
    B, H_q, H_kv, page_size, max_blocks, D = 2, 2, 1, 3, 4, 4
    N_max = page_size * max_blocks
    q = torch.randn(B, H_q, 2, D, generator=g, dtype=torch.float64)
    k_cache = torch.randn(B, H_kv, N_max, D, generator=g, dtype=torch.float64)
    v_cache = torch.randn(B, H_kv, N_max, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H_kv, 2, D, generator=g, dtype=torch.float64) for _ in range(2))
    table = torch.tensor([[6, 2, 7, 0], [1, 5, 3, 4]], dtype=torch.int32)
    k_pool = torch.zeros(8, H_kv, page_size, D, dtype=torch.float64)
    v_pool = torch.zeros_like(k_pool)
    for b in range(B):
        for p in range(max_blocks):  # page p of element b holds its keys [3 p, 3 p + 3)
            k_pool[table[b, p]] = k_cache[b, :, p * page_size : (p + 1) * page_size]
            v_pool[table[b, p]] = v_cache[b, :, p * page_size : (p + 1) * page_size]
    before = k_pool.clone()
    kwargs = {"cache_seqlens": torch.tensor([4, 7]), "block_n": 2, "num_splits": 2, "batch_index": 1, "head": 1}
    flat = replay_decode(q, k_cache, v_cache, k, v, **kwargs)
    paged = replay_decode(q, k_pool, v_pool, k, v, block_table=table, **kwargs)
    torch.testing.assert_close(paged.O, flat.O, atol=0, rtol=0)
    assert paged.ranges == flat.ranges and paged.N_max == flat.N_max == N_max
    assert paged.pages == (1, 5, 3)  # L = 7 + 2 = 9 keys: pages [0, 3) of row 1
    assert paged.page_of(4) == (5, 1) and paged.page_of(9) is None and flat.page_of(4) is None
    assert torch.equal(k_pool, before)  # the replay writes nothing
    out = io.StringIO()
    render_table(paged, file=out, width=200)
    text = out.getvalue()
    assert "paged, page_size 3, pages [1, 5, 3]" in text and "page" in text

    experiment = decode_to_experiment(paged)
    assert experiment["decode"]["pageSize"] == 3 and experiment["decode"]["pages"] == [1, 5, 3]
    assert "pages" not in decode_to_experiment(flat)["decode"]  # negative control: a contiguous cache has none
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator(schema()).validate(experiment)
    assert slot_label(paged, 4) == "4\nold\np5" and slot_label(paged, 9) == "9\nunused\n·"
    assert slot_label(flat, 4) == "4\nold"
    png = render_decode_png(paged, tmp_path / "paged.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
