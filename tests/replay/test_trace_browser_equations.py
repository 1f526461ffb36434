"""The equations panel in a real headless Chromium: every number it shows, at every update and for every row,
is the JSON's (4 significant digits), the row selector switches rows, and a row that has seen no key shows −∞."""

from __future__ import annotations

import json
import math

import torch

from flashattn_teach.replay import replay
from flashattn_teach.replay.html import render_html

from page_numbers import part_numbers
from replay_cli import main

READ_EQUATIONS = """(() => ({
  counter: document.getElementById("counter").textContent,
  shownRow: Number(document.querySelector("#equations .equations").dataset.row),
  buttons: [...document.querySelectorAll("#equations .equation-rows button")].map(
    b => [b.textContent, b.getAttribute("aria-pressed")]),
  equations: [...document.querySelectorAll("#equations .equation")].map(e => ({
    name: e.dataset.name, line: Number(e.dataset.line),
    symbolic: e.querySelector(".symbolic").textContent,
    text: e.querySelector(".substituted").textContent,
    numbers: [...e.querySelectorAll(".substituted .num")].map(n => n.textContent),
    note: e.querySelector(".note") ? e.querySelector(".note").textContent : null})),
}))()"""

MINUS_INF = "\u2212\u221e"


def click(browser, selector: str) -> None:
    """A real click on ``selector``, scrolled into view first (the panel sits below the fold)."""
    browser.evaluate(f"document.querySelector({json.dumps(selector)}).scrollIntoView({{block: 'center'}})")
    browser.click(selector)


def press_enter_on(browser, selector: str) -> None:
    """Focus ``selector`` and press Enter, as a keyboard user does after tabbing to it."""
    browser.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
    browser.press("Enter")


def assert_row_shown(page: dict, equations: list[dict]) -> None:
    assert [(e["name"], e["line"], e["symbolic"]) for e in page["equations"]] == [
        (e["name"], e["line"], e["symbolic"]) for e in equations
    ]
    for on_page, e in zip(page["equations"], equations, strict=True):
        want = part_numbers(e["parts"])
        assert len(on_page["numbers"]) == len(want), (on_page, e)
        for text, x in zip(on_page["numbers"], want, strict=True):
            if x is None:
                assert text == MINUS_INF, (e["name"], text)
            else:  # four significant digits
                assert len(text.lstrip("-").replace(".", "").split("e")[0].lstrip("0")) <= 4, text
                assert math.isclose(float(text), x, rel_tol=5.01e-4, abs_tol=1e-300), (e["name"], text, x)
        assert on_page["note"] == e.get("note")


def test_teaching_example_page_shows_every_equation_number_of_every_row(browser, tmp_path, capsys):
    base = "forward --seed 0 --dtype float64 --seq-len 6 --head-dim 4 --block-m 2 --block-n 2".split()
    assert main([*base, "--format", "json", "--extensions"]) == 0
    cases = json.loads(capsys.readouterr().out)["cases"]
    page_path = tmp_path / "replay.html"
    assert main([*base, "--format", "html", "--out", str(page_path)]) == 0
    browser.open(page_path)
    alphas = 0
    for n, case in enumerate(cases, start=1):
        if n > 1:
            click(browser, "#next")
        rows = case["equations"]["rows"]
        click(browser, '#equations .equation-rows button[data-row="0"]')
        for r in range(len(rows)):
            if r:
                click(browser, f'#equations .equation-rows button[data-row="{r}"]')
            page = browser.evaluate(READ_EQUATIONS)
            assert page["counter"] == f"Tile update {n} of {len(cases)}"
            assert page["shownRow"] == case["equations"]["rowStart"] + r
            assert [pressed for _, pressed in page["buttons"]] == [str(k == r).lower() for k in range(len(rows))]
            assert_row_shown(page, rows[r])
            alpha = next(e for e in page["equations"] if e["name"] == "alpha")
            want = next(e for e in rows[r] if e["name"] == "alpha")["value"]
            assert math.isclose(float(alpha["numbers"][-1]), want, rel_tol=5.01e-4, abs_tol=1e-300)
            alphas += 1
    assert alphas == len(cases) * 2
    # The selected row stays while stepping back; by keyboard, Enter on a focused row button switches rows.
    browser.press("ArrowLeft")
    page = browser.evaluate(READ_EQUATIONS)
    assert page["shownRow"] == 1 and page["counter"] == f"Tile update {len(cases) - 1} of {len(cases)}"
    assert_row_shown(page, cases[-2]["equations"]["rows"][1])
    press_enter_on(browser, '#equations .equation-rows button[data-row="0"]')
    page = browser.evaluate(READ_EQUATIONS)
    assert page["shownRow"] == 0
    assert_row_shown(page, cases[-2]["equations"]["rows"][0])
    assert browser.evaluate("document.activeElement.dataset.row") == "0"  # focus stays on the pressed button


def test_a_row_that_sees_no_key_shows_minus_infinity(browser, tmp_path):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 6, 4, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[0, :2] = False  # row 0 sees no key in the first tile
    r = replay(q, k, v, block_m=2, block_n=2, attn_mask=mask)
    page_path = tmp_path / "masked.html"
    page_path.write_text(render_html(r), encoding="utf-8")
    browser.open(page_path)
    page = browser.evaluate(READ_EQUATIONS)
    assert page["shownRow"] == 0
    shown = {e["name"]: e for e in page["equations"]}
    assert shown["m_new"]["numbers"] == [MINUS_INF, MINUS_INF, MINUS_INF]  # max(−∞, −∞) = −∞
    assert shown["alpha"]["numbers"] == [MINUS_INF, "0.000"] and "−∞ − 0" in shown["alpha"]["text"]
    assert "never computes −∞ − (−∞)" in shown["alpha"]["note"]
    experiment_rows = json.loads(browser.evaluate('document.getElementById("replay-data").textContent'))["cases"][0][
        "equations"
    ]["rows"]
    assert_row_shown(page, experiment_rows[0])
    click(browser, '#equations .equation-rows button[data-row="1"]')
    page = browser.evaluate(READ_EQUATIONS)
    assert page["shownRow"] == 1 and {e["name"]: e for e in page["equations"]}["m_new"]["numbers"][-1] != MINUS_INF
    assert_row_shown(page, experiment_rows[1])
