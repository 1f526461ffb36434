"""The replay page's layout in a real headless Chromium, at 1200 px and at phone width (390 px), for every tab:
nothing reaches past the viewport's right edge (wide grids and tables scroll inside their own box), no panel
is empty, the tabs and steppers work by keyboard; a screenshot of each tab at each width goes to
test-artifacts/. The tabs and panels are found on the page, so views added later are covered too."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from flashattn_teach.replay import replay, replay_backward
from flashattn_teach.replay.html import render_html
from flashattn_teach.replay.page_views import VIEWS

WIDTHS = (1200, 390)

# Every element whose box reaches past the right edge, unless an ancestor that clips or scrolls sideways
# (overflow-x not visible) holds it inside the viewport.
OVERFLOWING = """(() => {
  const W = document.documentElement.clientWidth, found = [];
  const clipped = e => { for (let a = e.parentElement; a; a = a.parentElement) {
    if (getComputedStyle(a).overflowX !== "visible") return a.getBoundingClientRect().right <= W + 0.5; }
    return false; };
  for (const e of document.body.querySelectorAll("*")) {
    const r = e.getBoundingClientRect();
    if (!r.width || !r.height || e.closest("[hidden]")) continue;
    if (r.right > W + 0.5 && !clipped(e)) found.push(`${e.tagName.toLowerCase()}#${e.id}.${e.className.baseVal ??
      e.className} right=${Math.round(r.right)}`);
  }
  return {scrollWidth: document.documentElement.scrollWidth, innerWidth: W, found: found.slice(0, 10)};
})()"""

# Every visible section, panel and panel body: it must hold text or elements.
EMPTY = """(() => [...document.querySelectorAll("section.view, .panel, .panel-body, .compare-column")]
  .filter(e => !e.closest("[hidden]") && e.getClientRects().length)
  .filter(e => !e.textContent.trim() && !e.querySelector("svg, canvas, img, table"))
  .map(e => e.id || e.className))()"""

READ = """(() => ({
  tabs: [...document.querySelectorAll("#tabs [role=tab]")].map(t => t.id),
  panels: [...document.querySelectorAll("section.view .panel, section.view .compare-column")].map(
    e => e.id || e.dataset.order),
  height: document.documentElement.scrollHeight,
}))()"""


def png_size(path: Path) -> tuple[int, int]:
    width, height = struct.unpack(">II", path.read_bytes()[16:24])  # the IHDR chunk
    return width, height


def teaching_options(q, k, v) -> dict:
    """A value for every render_html option a view declares, so that every view gets its tab."""
    known = {
        "compare": True,
        "backward": replay_backward(q, k, v, block_m=2, block_n=2),
        "gpu_heads": 4,
        "gpu_sms": 2,
        "gpu_programs_per_sm": 1,
    }
    declared = {name for view in VIEWS for name in view.options}
    missing = declared - set(known)
    assert not missing, f"views read options this test does not know yet, {sorted(missing)}: add them here"
    return {name: known[name] for name in declared}


@pytest.fixture(scope="module")
def teaching_page(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 6, 4, dtype=torch.float64) for _ in range(3))
    path = tmp_path_factory.mktemp("layout") / "teaching.html"
    path.write_text(render_html(replay(q, k, v, block_m=2, block_n=2), **teaching_options(q, k, v)), encoding="utf-8")
    return path


def test_every_tab_fits_the_width_and_has_no_empty_panel(teaching_page, browser, artifacts):
    seen = {}
    for width in WIDTHS:
        browser.open(teaching_page, width=width, height=900)
        tabs = browser.evaluate(READ)["tabs"]
        assert tabs[0] == "tab-forward"
        assert set(tabs) >= {f"tab-{v.key}" for v in VIEWS if not v.panel}  # every tab has data
        panels = browser.evaluate(READ)["panels"]
        # every forward panel is drawn but the kernel's, which needs source="triton" (test_trace_kernel_page.py)
        assert {v.key for v in VIEWS if v.panel} - {"kernel"} <= set(panels), panels
        for tab in tabs:
            browser.click(f"#{tab}")
            assert browser.evaluate("document.body.dataset.view") == tab.removeprefix("tab-")
            browser.press("ArrowRight")  # one step on, so the drawn state is not only the first one
            overflow = browser.evaluate(OVERFLOWING)
            assert overflow["scrollWidth"] <= overflow["innerWidth"], (width, tab, overflow)
            assert not overflow["found"], (width, tab, overflow)
            assert browser.evaluate(EMPTY) == [], (width, tab)
            shot = artifacts / f"layout-{tab.removeprefix('tab-')}-{width}.png"
            browser.screenshot(shot)
            shot_width, shot_height = png_size(shot)
            assert shot_width <= width, (shot, shot_width)  # the whole page is no wider than the viewport
            seen[width, tab] = {**browser.evaluate(READ), "shot_height": shot_height}
    for tab in seen[WIDTHS[0], "tab-forward"]["tabs"]:  # the same content reflowed: taller, nothing dropped
        wide, narrow = seen[1200, tab], seen[390, tab]
        assert narrow["tabs"] == wide["tabs"] and narrow["panels"] == wide["panels"], tab
        assert narrow["height"] >= wide["height"] and narrow["shot_height"] >= wide["shot_height"], tab


def test_the_probes_see_an_overflow_and_an_empty_panel(teaching_page, browser):
    """Negative control: a box wider than the phone and an empty panel body are found."""
    browser.open(teaching_page, width=390, height=900)
    browser.evaluate(
        "(() => { const section = document.querySelector('section.view:not([hidden])');"
        " const wide = Object.assign(document.createElement('div'), {id: 'wide', textContent: 'x'});"
        " wide.style.width = '900px';"
        " section.append(wide, Object.assign(document.createElement('div'), {className: 'panel-body', id: 'probe'}));"
        " })()"
    )
    overflow = browser.evaluate(OVERFLOWING)
    assert overflow["scrollWidth"] > overflow["innerWidth"] and any("#wide" in f for f in overflow["found"])
    assert browser.evaluate(EMPTY) == ["probe"]


def test_tabs_are_reached_by_the_tab_key_and_arrow_keys_step(teaching_page, browser):
    browser.open(teaching_page, width=390, height=900)
    tabs = browser.evaluate(READ)["tabs"]
    focused = []
    for _ in range(len(tabs) + 2):
        browser.press("Tab")
        focused.append(browser.evaluate("document.activeElement.id"))
    assert focused[: len(tabs)] == tabs  # every tab, in order, before anything else
    browser.open(teaching_page, width=390, height=900)
    browser.press("Tab")  # on the first tab
    for tab in tabs[1:]:
        browser.press("Tab")  # the tabs stay in the Tab order whichever is open
        assert browser.evaluate("document.activeElement.id") == tab
        outline = browser.evaluate("getComputedStyle(document.activeElement).outlineStyle")
        assert outline not in ("", "none"), outline  # a visible focus ring
        browser.press("Enter")
        key = tab.removeprefix("tab-")
        assert browser.evaluate("document.body.dataset.view") == key
        counter = f"document.querySelector('#view-{key} .controls .counter')?.textContent ?? null"
        before = browser.evaluate(counter)
        if before is None:  # a view without a stepper
            continue
        browser.press("ArrowRight")  # the arrow keys step the view, with the focus still on its tab
        assert browser.evaluate(counter) != before, tab
        browser.press("ArrowLeft")
        assert browser.evaluate(counter) == before, tab
