"""The decode step's page in a real headless Chromium: step through every event (tile updates, merges, the sink,
the result) by button and by arrow key and compare what the page shows (the cache strip, the matrices, the
equations' numbers, the error) with the payload embedded in the same page, to 4 significant digits; at phone
width (390 px) nothing makes the page scroll sideways."""

from __future__ import annotations

import json
import re

import pytest

from flashattn_teach.replay.html import render_decode_html

from decode_page_cases import paged_step, sink_step, window_step
from page_numbers import assert_numbers, assert_shown, part_numbers
from replay_cli import main

READ_PAGE = """(() => {
  const view = document.getElementById("view-decode");
  const text = e => e ? e.textContent : null;
  return {
    hidden: view.hidden,
    counter: text(document.getElementById("dec-counter")),
    label: text(document.getElementById("dec-label")),
    position: text(document.getElementById("dec-position")),
    event: view.dataset.event,
    states: Object.fromEntries([...document.querySelectorAll("#dec-cache tr[data-name=key] td")].map(
      td => [td.dataset.key, td.className])),
    cache: Object.fromEntries([...document.querySelectorAll("#dec-cache tr")].map(
      tr => [tr.dataset.name, [...tr.cells].slice(1).map(c => c.textContent)])),
    matrices: Object.fromEntries([...document.querySelectorAll("#dec-body table.matrix")].map(t => [t.dataset.name,
      [...t.rows].map(r => [...r.cells].map(c => c.textContent))])),
    keys: [...document.querySelectorAll("#dec-keys tr[data-key]")].map(tr => [...tr.cells].map(c => c.textContent)),
    equations: [...document.querySelectorAll("#dec-equations li")].map(li => ({name: li.dataset.name,
      symbolic: li.querySelector(".symbolic").textContent,
      numbers: [...li.querySelectorAll(".num")].map(n => n.textContent)})),
    rows: [...document.querySelectorAll("#dec-rows button")].map(b => b.getAttribute("aria-pressed")),
    error: document.getElementById("dec-error") && Number(document.getElementById("dec-error").dataset.value),
    prev: document.getElementById("dec-prev").disabled,
    next: document.getElementById("dec-next").disabled,
    scrollWidth: document.documentElement.scrollWidth,
    innerWidth: window.innerWidth,
  };
})()"""

SINK_ARGS = "decode --seed 0 --cache-len 5 --new-kv 2 --new-queries 2 --num-splits 3 --block-n 2 --head-dim 4"


def assert_equations(page: dict, equations: list[dict]) -> None:
    assert [(e["name"], e["symbolic"]) for e in page["equations"]] == [(e["name"], e["symbolic"]) for e in equations]
    for shown_eq, eq in zip(page["equations"], equations, strict=True):
        expected = part_numbers(eq["parts"])
        assert len(shown_eq["numbers"]) == len(expected), eq["name"]
        for text, x in zip(shown_eq["numbers"], expected, strict=True):
            assert_shown(text, x)


def expected_state(d: dict, e: dict, key: int) -> str:
    """The cache strip's colour for slot ``key`` at event ``e``, written out from the event's meaning."""
    split = d["slots"][key]["split"]
    if split is None:
        return "skipped"
    if e["event"] == "result":
        return "done"
    if e["event"] == "tile":
        if e["cols"][0] <= key < e["cols"][1]:
            return "current"
        if split == e["split"]:
            return "accumulated" if key < e["cols"][0] else "pending"
        return "done" if split < e["split"] else "pending"
    if split == e["split"]:
        return "current"
    return "accumulated" if split in e["merged"] else "done"


def assert_event_shows(page: dict, d: dict, n: int, row: int = 0) -> None:
    events = d["events"]
    e = events[n]
    assert not page["hidden"] and page["event"] == e["event"]
    assert page["counter"] == f"Event {n + 1} of {len(events)}"
    assert (page["prev"], page["next"]) == (n == 0, n == len(events) - 1)
    for key in range(d["cacheSize"]):
        assert page["states"][str(key)] == expected_state(d, e, key), (n, key)
    assert page["cache"]["role"][-d["cacheSize"] :] == [s["role"] for s in d["slots"]]
    if d["pageSize"] is not None:
        for name in ("page", "block", "slot"):
            assert page["cache"][name][-d["cacheSize"] :] == [
                "·" if s[name] is None else str(s[name]) for s in d["slots"]
            ]
    if d["sink"] is not None:
        sink_now = e["event"] == "merge" and e["split"] is None
        assert page["states"]["sink"] == ("current" if sink_now else "done" if e["event"] == "result" else "pending")
    if e["event"] == "tile":
        c0, c1 = e["cols"]
        assert f"Split {e['split']} · tile update {e['update']} of {e['updates']}" in page["label"]
        assert [k[0] for k in page["keys"]] == [str(j) for j in range(c0, c1)]
        if d["pageSize"] is not None:  # each key of the tile with its page, block id and slot
            slots = [d["slots"][j] for j in range(c0, c1)]
            assert [k[2:] for k in page["keys"]] == [[str(s["page"]), str(s["block"]), str(s["slot"])] for s in slots]
        assert_numbers(page["matrices"]["m_i"], e["m"])
        assert_numbers(page["matrices"]["l_i"], e["l"])
        assert_numbers(page["matrices"]["O_partial"], e["output"])
        if e["last"]:
            assert_numbers(page["matrices"]["O_s"], e["partial"]["output"])
            assert_numbers(page["matrices"]["lse_s"], e["partial"]["lse"])
        else:
            assert "O_s" not in page["matrices"]
        assert_equations(page, e["equations"]["rows"][row])
    elif e["event"] == "merge":
        assert page["label"] == f"Merge {e['merge']} · {e['label']}"
        for name, key in (("lse_a", "lseA"), ("lse_b", "lseB"), ("lse", "lse"), ("w_a", "weightA"), ("w_b", "weightB")):
            assert_numbers(page["matrices"][name], e[key])
        for name, key in (("O_a", "outputA"), ("O_b", "outputB"), ("O", "output")):
            assert_numbers(page["matrices"][name], e[key])
        assert_equations(page, e["equations"][row])
    else:
        assert_numbers(page["matrices"]["O"], e["output"])
        assert_numbers(page["matrices"]["O_final"], e["denseOutput"])
        assert_numbers(page["matrices"]["lse"], e["lse"])
        assert_numbers(page["matrices"]["lse_final"], e["denseLse"])
        assert page["error"] == e["maxDiff"] <= 1e-12
        assert page["equations"] == []
    assert page["rows"] == ([] if e["event"] == "result" else [str(r == row).lower() for r in range(d["newQueries"])])


def payload(path) -> dict:
    text = path.read_text(encoding="utf-8")
    match = re.search(r'<script type="application/json" id="view-data">(.*?)</script>', text, re.S)
    assert match is not None
    return json.loads(match.group(1))["decode"]


@pytest.mark.parametrize("name", ["cli-sink", "paged", "window"])
def test_decode_page_steps_through_every_event_and_shows_the_payloads_numbers(name, browser, tmp_path, artifacts):
    path = tmp_path / f"decode-{name}.html"
    if name == "cli-sink":
        assert (
            main([*SINK_ARGS.split(), "--dtype", "float64", "--sinks", "0.5", "--format", "html", "--out", str(path)])
            == 0
        )
    else:
        path.write_text(render_decode_html(paged_step() if name == "paged" else window_step()), encoding="utf-8")
    d = payload(path)
    kinds = [e["event"] for e in d["events"]]
    assert kinds.count("result") == 1 and "tile" in kinds and "merge" in kinds
    if name == "cli-sink":
        assert d["events"][-2]["split"] is None  # the sink's merge is the last
    if name == "paged":
        assert d["pageSize"] == 3 and d["pages"] == [1, 5, 3]

    browser.open(path, width=1200, height=900)
    total = len(d["events"])
    assert_event_shows(browser.evaluate(READ_PAGE), d, 0)
    for n in range(1, total):  # forward alternately by key and by button
        if n % 2:
            browser.press("ArrowRight")
        else:
            browser.click("#dec-next")
        assert_event_shows(browser.evaluate(READ_PAGE), d, n)
        if d["events"][n]["event"] != "result" and d["newQueries"] > 1:  # the other row's equations, on demand
            browser.click('#dec-rows button[data-row="1"]')
            assert_event_shows(browser.evaluate(READ_PAGE), d, n, row=1)
            browser.click('#dec-rows button[data-row="0"]')
    browser.screenshot(artifacts / f"decode-{name}.png")
    browser.press("ArrowRight")  # past the end: stays on the result
    assert browser.evaluate(READ_PAGE)["counter"] == f"Event {total} of {total}"
    browser.click("#dec-prev")
    assert_event_shows(browser.evaluate(READ_PAGE), d, total - 2)
    browser.press("ArrowLeft")
    assert_event_shows(browser.evaluate(READ_PAGE), d, total - 3)
    requests = browser.requested_urls()
    assert requests and all(url.startswith(("file://", "data:")) for url in requests), requests


def test_decode_page_fits_a_phone_at_every_event(browser, tmp_path, artifacts):
    path = tmp_path / "decode-paged.html"
    path.write_text(render_decode_html(paged_step()), encoding="utf-8")
    browser.open(path, width=390, height=900)
    d = payload(path)
    for n in range(len(d["events"])):
        page = browser.evaluate(READ_PAGE)
        assert page["counter"] == f"Event {n + 1} of {len(d['events'])}"
        assert page["scrollWidth"] <= page["innerWidth"], (n, page["scrollWidth"])
        browser.press("ArrowRight")
    browser.screenshot(artifacts / "decode-paged-390.png")
    # negative control: a box wider than the phone is seen by the same probe
    browser.evaluate(
        "document.getElementById('view-decode').append(Object.assign(document.createElement('div'), "
        "{style: 'width: 900px', textContent: 'x'}))"
    )
    page = browser.evaluate(READ_PAGE)
    assert page["scrollWidth"] > page["innerWidth"]


def test_the_sink_step_page_opens_on_the_first_event_with_no_tab_bar(browser, tmp_path):
    path = tmp_path / "decode-sink.html"
    path.write_text(render_decode_html(sink_step()), encoding="utf-8")
    browser.open(path, width=1200, height=900)
    assert browser.evaluate("document.getElementById('tabs').hidden") is True  # one view: no tabs
    assert browser.evaluate("document.body.dataset.view") == "decode"
    assert browser.evaluate("document.getElementById('title').textContent") == "Decode step replay"
