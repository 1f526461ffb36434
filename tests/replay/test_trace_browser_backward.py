"""The backward view in a real headless Chromium: step through every backward step by button and by key and
compare what the page shows (tile, matrices, equations, the final error) with the JSON of the same replay."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flashattn_teach.replay.html import render_html
from flashattn_teach.replay.replay import replay

from page_numbers import assert_numbers
from replay_cli import main

READ_PAGE = """(() => {
  const view = document.getElementById("view-backward");
  return {
    hidden: view.hidden,
    tab: document.getElementById("tab-backward").getAttribute("aria-selected"),
    counter: document.getElementById("bwd-counter").textContent,
    label: document.getElementById("bwd-label").textContent,
    states: Object.fromEntries([...document.querySelectorAll("#bwd-grid rect")].map(
      e => [e.dataset.i + "," + e.dataset.j, e.dataset.state])),
    matrices: Object.fromEntries([...document.querySelectorAll("#bwd-matrices table.matrix")].map(t => [t.dataset.name,
      [...t.rows].map(r => [...r.cells].map(c => c.textContent))])),
    equations: [...document.querySelectorAll("#bwd-equations li")].map(li => ({name: li.dataset.name,
      symbolic: li.querySelector(".symbolic").textContent, substituted: li.querySelector(".substituted").textContent})),
    resultHidden: document.getElementById("bwd-result").hidden,
    worst: document.getElementById("bwd-worst") && Number(document.getElementById("bwd-worst").dataset.value),
    errors: Object.fromEntries([...document.querySelectorAll("#bwd-errors tr")].map(
      tr => [tr.dataset.name, tr.cells[1].textContent])),
    prev: document.getElementById("bwd-prev").disabled,
    next: document.getElementById("bwd-next").disabled,
    title: document.getElementById("title").textContent,
    stepCounters: view.innerText.match(/\\bstep \\d+ of\\b/gi),
  };
})()"""


def assert_step_shows(page: dict, doc: dict, n: int) -> None:
    steps, total = doc["steps"], len(doc["steps"]) + 1
    assert not page["hidden"] and page["tab"] == "true"
    assert page["counter"] == f"Backward step {n + 1} of {total}"
    assert page["stepCounters"] == [f"step {n + 1} of"]  # one counter for one step: the stepper's
    assert page["title"] == "Tile replay: backward (FA2 Alg. 2), every tile of both passes"
    assert (page["prev"], page["next"]) == (n == 0, n == total - 1)
    assert page["resultHidden"] == (n < len(steps))
    if n == len(steps):  # the result: the gradients and the error against the oracle
        for name, grad in doc["gradients"].items():
            assert_numbers(page["matrices"][name], grad)
            assert_numbers(page["matrices"][f"{name} (oracle)"], doc["oracle"][name])
            assert math.isclose(float(page["errors"][name]), doc["maxError"][name], rel_tol=5.01e-4, abs_tol=1e-300)
        assert page["worst"] == max(doc["maxError"].values())
        assert page["worst"] <= 1e-12
        assert all(state in ("done", "skipped") for state in page["states"].values())
        return
    step = steps[n]
    assert [(e["name"], e["symbolic"], e["substituted"]) for e in page["equations"]] == [
        (e["name"], f"{e['name']} = {e['symbolic']}", f"= {e['substituted']}") for e in step["equations"]
    ]
    if step["stepKind"] == "preprocess":
        assert page["label"].startswith("Preprocess")
        for name in ("O", "dO", "lse", "delta"):
            assert_numbers(page["matrices"][name], doc["inputs"][name])
        assert set(page["states"].values()) <= {"pending", "skipped"}
        return
    assert f"tile (i={step['i']}, j={step['j']})" in page["label"]
    for name in ("P_ij", "dP_ij", "dS_ij"):
        assert_numbers(page["matrices"][name], step[name])
    for name, values in step["acc"].items():
        assert_numbers(page["matrices"][name], values)
    assert page["states"][f"{step['i']},{step['j']}"] == "current"
    for i, j in doc["skipped"]:
        assert page["states"][f"{i},{j}"] == "skipped"
    earlier = [s for s in steps[:n] if s["stepKind"] == step["stepKind"]]
    for s in earlier:  # the tiles of the same accumulator are green, the pass's others done
        same = s["j"] == step["j"] if step["stepKind"] == "dkdv" else s["i"] == step["i"]
        assert page["states"][f"{s['i']},{s['j']}"] == ("accumulated" if same else "done")
    assert list(page["states"].values()).count("current") == 1


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("teaching", []),
        ("causal-sink-softcap", "--causal --sinks 0.5 --softcap 2".split()),
        ("masked-row", "--seq-len 5 --block-m 2 --block-n 3 --causal --mask MASK".split()),
        ("every-key-padded", "--seq-len 5 --batch 2 --batch-index 1 --pad-left 0,5".split()),
    ],
)
def test_backward_view_steps_through_every_step_and_shows_the_json_numbers(
    name, options, browser, tmp_path, artifacts, capsys
):
    mask = torch.ones(5, 5, dtype=torch.bool)
    mask[3] = False  # query 3 sees no key: its gradients are 0
    torch.save(mask, tmp_path / "mask.pt")
    options = [str(tmp_path / "mask.pt") if x == "MASK" else x for x in options]
    base = ["backward", "--seed", "0", "--dtype", "float64", *options]
    assert main([*base, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    page_path = tmp_path / "backward.html"
    assert main([*base, "--format", "html", "--out", str(page_path)]) == 0

    browser.open(page_path)  # the page opens on the backward view
    total = len(doc["steps"]) + 1
    assert_step_shows(browser.evaluate(READ_PAGE), doc, 0)
    for n in range(1, total):  # forward alternately by button and by key
        if n % 2:
            browser.press("ArrowRight")
        else:
            browser.click("#bwd-next")
        assert_step_shows(browser.evaluate(READ_PAGE), doc, n)
    browser.screenshot(artifacts / f"backward-{name}.png")
    browser.press("ArrowRight")  # past the end: stays on the result
    assert browser.evaluate(READ_PAGE)["counter"] == f"Backward step {total} of {total}"
    browser.click("#bwd-prev")
    assert_step_shows(browser.evaluate(READ_PAGE), doc, total - 2)
    browser.press("ArrowLeft")
    assert_step_shows(browser.evaluate(READ_PAGE), doc, max(0, total - 3))
    requests = browser.requested_urls()
    assert requests and all(url.startswith(("file://", "data:")) for url in requests), requests


def test_the_backward_tab_opens_by_click_from_the_forward_view(browser, tmp_path):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 6, 4, dtype=torch.float64) for _ in range(3))
    r = replay(q, k, v, block_m=2, block_n=2, causal=True)
    page_path = tmp_path / "page.html"
    page_path.write_text(render_html(r, backward=True), encoding="utf-8")
    browser.open(page_path)
    assert browser.evaluate('document.getElementById("view-backward").hidden') is True
    assert browser.evaluate('document.getElementById("title").textContent').startswith("Tile replay: forward, ")
    browser.click("#tab-backward")
    page = browser.evaluate(READ_PAGE)
    assert not page["hidden"] and page["tab"] == "true" and page["counter"].startswith("Backward step 1 of ")
    browser.press("ArrowRight")  # the keys now step the backward view
    assert browser.evaluate(READ_PAGE)["counter"].startswith("Backward step 2 of ")
