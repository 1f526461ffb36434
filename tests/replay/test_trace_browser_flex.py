"""The replay page under FlexAttention's block mask, in headless Chromium: the heading names the block mask, the
grid draws its SKIP tiles as skipped and, in the tiles it visits, masks exactly the cells ``mask_mod`` hides."""

from __future__ import annotations

import torch

from flashattn_teach import create_block_mask
from flashattn_teach.replay import replay
from flashattn_teach.replay.html import render_html

READ = """(() => ({
  meta: document.getElementById("meta").textContent,
  position: document.getElementById("position").textContent,
  states: Object.fromEntries([...document.querySelectorAll("#grid rect")].map(
    e => [e.dataset.row + "," + e.dataset.column, e.dataset.state])),
  masked: [...document.querySelectorAll("#grid rect.masked")].map(e => e.dataset.row + "," + e.dataset.column),
}))()"""

DOCS = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])


def document(b, h, q_idx, kv_idx):
    return (DOCS[q_idx] == DOCS[kv_idx]) & (q_idx >= kv_idx)


def test_the_page_draws_the_block_masks_tiles_and_cells(browser, tmp_path, artifacts):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, 4, generator=g, dtype=torch.float64) for _ in range(3))
    bm = create_block_mask(document, None, None, 8, 8, device="cpu", BLOCK_SIZE=2)
    r = replay(q, k, v, block_m=2, block_n=2, query_block=3, block_mask=bm)
    path = tmp_path / "flex.html"
    path.write_text(render_html(r), encoding="utf-8")
    browser.open(path)
    page = browser.evaluate(READ)
    assert "block_mask" in page["meta"]
    kinds = bm.block_kinds[0, 0]
    skipped = {f"{2 * i},{2 * j}" for i, j in (kinds == 0).nonzero().tolist()}
    assert skipped == {cell for cell, state in page["states"].items() if state == "skipped" and cell in _corners()}
    # the cells drawn pale: every hidden cell of a tile that is not skipped (the whole grid is drawn)
    hidden = ~document(0, 0, torch.arange(8)[:, None], torch.arange(8)[None, :])
    want = {f"{i},{j}" for i, j in hidden.nonzero().tolist() if int(kinds[i // 2, j // 2]) != 0}
    assert set(page["masked"]) == want
    first = next(iter(r.steps))
    assert page["position"].startswith(f"tile (i=3, j={first.j}), {first.kind.name}")
    browser.screenshot(artifacts / "replay-flex-document.png")


def _corners() -> set[str]:
    return {f"{r},{c}" for r in range(0, 8, 2) for c in range(0, 8, 2)}
