"""The HTML page in a real headless Chromium: step with the buttons and arrow keys, compare with the JSON."""

from __future__ import annotations

import json
import math

import pytest

from page_numbers import assert_shown
from replay_cli import main

READ_PAGE = """(() => ({
  counter: document.getElementById("counter").textContent,
  label: document.getElementById("case-label").textContent,
  id: document.body.dataset.case,
  vectors: [...document.querySelectorAll("#vectors .vector")].map(v => ({
    label: v.querySelector(".label").textContent,
    values: [...v.querySelectorAll(".value")].map(e => e.textContent)})),
  metrics: [...document.querySelectorAll("#metrics tr")].map(tr => [tr.cells[0].textContent, tr.cells[1].textContent]),
  states: Object.fromEntries([...document.querySelectorAll("#grid rect")].map(
    e => [e.dataset.row + "," + e.dataset.column, e.dataset.state])),
  masked: [...document.querySelectorAll("#grid rect.masked")].map(e => e.dataset.row + "," + e.dataset.column),
  sink: [...document.querySelectorAll("#sink .value.share")].map(e => e.textContent),
  sinkHidden: document.getElementById("sink").hidden,
  prev: document.getElementById("prev").disabled,
  next: document.getElementById("next").disabled,
  title: document.getElementById("title").textContent,
  docTitle: document.title,
  legendMasked: document.getElementById("legend-masked") && document.getElementById("legend-masked").textContent,
}))()"""


def assert_page_shows(page: dict, case: dict, n: int, total: int) -> None:
    assert page["counter"] == f"Tile update {n} of {total}"
    assert page["label"] == case["label"] and page["id"] == case["id"]
    assert [v["label"] for v in page["vectors"]] == [v["label"] for v in case["vectors"]]
    for on_page, vector in zip(page["vectors"], case["vectors"], strict=True):
        assert len(on_page["values"]) == len(vector["values"])
        for text, x in zip(on_page["values"], vector["values"], strict=True):
            assert_shown(text, x)
    assert [label for label, _ in page["metrics"]] == [m["label"] for m in case["metrics"]]
    assert int(page["metrics"][0][1]) == case["metrics"][0]["value"]
    assert int(page["metrics"][1][1]) == case["metrics"][1]["value"]
    assert math.isclose(float(page["metrics"][2][1]), case["metrics"][2]["value"], rel_tol=5.01e-4, abs_tol=1e-300)
    assert page["sinkHidden"] == ("sinkShare" not in case)
    assert len(page["sink"]) == len(case.get("sinkShare", []))
    for text, x in zip(page["sink"], case.get("sinkShare", []), strict=True):
        assert math.isclose(float(text), x, rel_tol=5.01e-4), (text, x)
    assert (page["prev"], page["next"]) == (n == 1, n == total)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("seed-query-major", "--seq-len 6 --block-m 2 --block-n 2".split()),
        ("causal-key-major", "--seq-len 7 --block-m 3 --block-n 2 --query-block 1 --causal --order key_major".split()),
        (
            "window-left-pad",
            "--seq-len 8 --query-block 3 --window 2,0 --batch 2 --batch-index 1 --pad-left 0,5".split(),
        ),
        ("causal-sink", "--seq-len 6 --block-m 3 --query-block 1 --causal --sinks 0.5".split()),
    ],
)
def test_html_page_steps_through_updates_and_shows_the_json_numbers(
    name, options, browser, tmp_path, artifacts, capsys
):
    base = ["forward", "--seed", "0", "--dtype", "float64", *options]
    assert main([*base, "--format", "json", "--extensions"]) == 0
    experiment = json.loads(capsys.readouterr().out)
    page_path = tmp_path / "replay.html"
    assert main([*base, "--format", "html", "--out", str(page_path)]) == 0

    browser.open(page_path)
    cases, total = experiment["cases"], len(experiment["cases"])
    page = browser.evaluate(READ_PAGE)
    assert_page_shows(page, cases[0], 1, total)
    # the title names the view, not a slogan: the query block and its rows, as the options give them
    block_m = int(options[options.index("--block-m") + 1]) if "--block-m" in options else 2
    i = int(options[options.index("--query-block") + 1]) if "--query-block" in options else 0
    seq_len = int(options[options.index("--seq-len") + 1])
    rows = f"rows {i * block_m}–{min(seq_len, (i + 1) * block_m) - 1}"
    assert page["title"] == page["docTitle"] == f"Tile replay: forward, query block i = {i} ({rows})"
    drawn_masked = bool(page["masked"])
    for n in range(2, total + 1):  # forward alternately by button and by key
        if n % 2:
            browser.press("ArrowRight")
        else:
            browser.click("#next")
        page = browser.evaluate(READ_PAGE)
        assert_page_shows(page, cases[n - 1], n, total)
        drawn_masked |= bool(page["masked"])
        tiles = cases[n - 1]["tiles"]
        s = cases[n - 1]["schedule"]
        assert page["states"][f"{s['rowStart']},{s['columnStart']}"] == "current"
        for i, j in tiles["done"]:
            want = "accumulated" if i == tiles["i"] else "done"
            assert page["states"][f"{i * experiment['replay']['blockM']},{j * experiment['replay']['blockN']}"] == want
    for i, j in experiment["replay"]["skipped"]:
        assert page["states"][f"{i * experiment['replay']['blockM']},{j * experiment['replay']['blockN']}"] == "skipped"
    browser.screenshot(artifacts / f"replay-{name}.png")
    # the pale masked cells have a legend entry, when the page draws any (no mask: none, and no entry)
    assert drawn_masked == (name != "seed-query-major")
    assert (page["legendMasked"] is not None) == drawn_masked
    assert drawn_masked is False or "masked cell" in page["legendMasked"]
    if name == "window-left-pad":  # pale: the visited tiles' cells outside the band (row 6 sees keys 4-6) or padded
        assert {"6,7", "7,4"} <= set(page["masked"]) and "6,5" not in page["masked"] and "1,0" not in page["masked"]
        assert "6,4" in page["masked"] and "5,5" not in page["masked"]  # keys 0-4 of element 1 are padding

    browser.press("ArrowRight")  # past the end: stays on the last update
    assert browser.evaluate(READ_PAGE)["counter"] == f"Tile update {total} of {total}"
    browser.click("#prev")
    assert_page_shows(browser.evaluate(READ_PAGE), cases[total - 2], total - 1, total)
    browser.press("ArrowLeft")
    assert browser.evaluate(READ_PAGE)["counter"] == f"Tile update {max(1, total - 2)} of {total}"

    requests = browser.requested_urls()
    assert requests and all(url.startswith(("file://", "data:")) for url in requests), requests
