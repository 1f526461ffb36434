"""The memory panel in a real headless Chromium: at every tile update it shows memory.py's numbers."""

from __future__ import annotations

import pytest
import torch

from flashattn_teach.replay import replay
from flashattn_teach.replay.html import render_html
from flashattn_teach.replay.memory import memory_figure

READ_PANEL = """(() => ({
  counter: document.getElementById("counter").textContent,
  summary: document.getElementById("memory-summary").textContent,
  chip: [...document.querySelectorAll("#memory-chip tr[data-buffer]")].map(
    tr => [tr.dataset.buffer, tr.cells[1].textContent, tr.cells[2].textContent]),
  chipTotal: document.getElementById("memory-chip-total").textContent,
  hbm: Object.fromEntries([...document.querySelectorAll("#memory-hbm .value")].map(
    e => [e.dataset.tensor + "/" + e.dataset.kind, e.textContent])),
  bars: Object.fromEntries([...document.querySelectorAll("#memory-hbm td")].map(
    td => [td.querySelector(".value").dataset.tensor + "/" + td.querySelector(".value").dataset.kind,
           td.querySelector(".mem-bar").style.width])),
}))()"""


def _bytes(text: str) -> int:
    assert text.endswith(" B"), text
    return int(text[:-2])


@pytest.mark.parametrize(
    ("order", "causal", "block_m", "block_n", "n"),
    [("query_major", False, 2, 2, 6), ("key_major", True, 3, 2, 7), ("query_major", True, 2, 3, 7)],
)
def test_memory_panel_shows_the_figure_at_every_update(
    order, causal, block_m, block_n, n, browser, tmp_path, artifacts
):
    torch.manual_seed(0)
    q, k, v = (torch.randn(n, 4, dtype=torch.float64) for _ in range(3))
    r = replay(q, k, v, block_m=block_m, block_n=block_n, causal=causal, order=order, query_block=1)
    figure = memory_figure(r)  # the oracle: the Python figure, not the page's payload
    path = tmp_path / "replay.html"
    path.write_text(render_html(r), encoding="utf-8")
    browser.open(path)
    dense_total = figure.dense.total_bytes
    for step in figure.steps:
        if step.index:
            browser.click("#next")
        page = browser.evaluate(READ_PANEL)
        assert page["counter"] == f"Tile update {step.index + 1} of {len(figure.steps)}"
        assert f"Schedule position {step.position + 1} of {figure.schedule_length}" in page["summary"]
        assert page["chip"] == [[b.name, " × ".join(map(str, b.shape)), f"{b.bytes} B"] for b in step.on_chip]
        assert _bytes(page["chipTotal"]) == step.on_chip_bytes
        tensors = {*figure.total.reads, *figure.total.writes, *figure.dense.reads, *figure.dense.writes}
        for t in tensors:
            assert _bytes(page["hbm"][f"{t}/read"]) == step.hbm.reads.get(t, 0), t
            assert _bytes(page["hbm"][f"{t}/written"]) == step.hbm.writes.get(t, 0), t
            assert _bytes(page["hbm"][f"{t}/dense-read"]) == figure.dense.reads.get(t, 0), t
            assert _bytes(page["hbm"][f"{t}/dense-written"]) == figure.dense.writes.get(t, 0), t
        assert _bytes(page["hbm"]["all/read"]) == step.hbm.read_bytes
        assert _bytes(page["hbm"]["all/written"]) == step.hbm.write_bytes
        width = float(page["bars"]["all/read"].rstrip("%"))
        assert width == pytest.approx(100 * step.hbm.read_bytes / dense_total, rel=1e-4)  # style widths keep 6 digits
    browser.screenshot(artifacts / f"replay-memory-{order}.png")


OVERFLOW = """(() => [...document.querySelectorAll("#memory, #memory *")]
  .filter(e => e.getBoundingClientRect().right > document.documentElement.clientWidth + 0.5)
  .map(e => e.tagName + (e.id ? "#" + e.id : "") + " " + Math.round(e.getBoundingClientRect().right)))()"""


def test_memory_panel_fits_a_phone_width(browser, tmp_path, artifacts):
    r = replay(*(torch.randn(6, 4, dtype=torch.float64) for _ in range(3)), block_m=2, block_n=2, order="key_major")
    path = tmp_path / "replay.html"
    path.write_text(render_html(r), encoding="utf-8")
    browser.open(path, width=390)
    assert browser.evaluate("document.querySelectorAll('#memory-hbm td').length") > 0
    assert browser.evaluate(OVERFLOW) == []
    browser.screenshot(artifacts / "replay-memory-390.png")
