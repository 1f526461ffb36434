"""``flashattn-teach replay forward --source triton``: the JSON (schema-valid, both columns and the difference per
term), the table, and the page's kernel panel in a real headless Chromium, whose every number is the JSON's."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("triton")

from flashattn_teach.replay.kernel_trace import KERNEL_TERMS, NOTE, PRODUCTION_NOTE
from flashattn_teach.replay.manifest import schema

from replay_cli import main


def read_panel(panel: str, table: str, counter: str = "counter") -> str:
    """The script that reads the kernel panel ``#panel`` (its table ``#table``; the view's stepper's counter
    ``#counter``): whether it is hidden, its rows, its note and its meta lines."""
    return f"""(() => ({{
  counter: document.getElementById("{counter}").textContent,
  hidden: document.getElementById("{panel}").hidden,
  rows: [...document.querySelectorAll("#{table} tr[data-term]")].map(r => ({{
    term: r.dataset.term, row: r.dataset.row,
    reference: r.querySelector(".reference").textContent, kernel: r.querySelector(".kernel").textContent,
    difference: r.querySelector(".difference").textContent}})),
  note: document.querySelector("#{panel} .kernel-note")?.textContent ?? null,
  meta: document.querySelector("#{panel} .meta")?.textContent ?? null,
  metas: [...document.querySelectorAll("#{panel} p.meta")].map(p => p.textContent),
}}))()"""


READ_KERNEL = read_panel("kernel", "kernel-terms")

# 40 rows and keys, D = 16, float32, causal: query block 1 of the kernel's 16 x 16 tiles has two updates
MULTI = "forward --dtype float32 --seq-len 40 --head-dim 16 --block-m 16 --block-n 16 --causal --query-block 1"


def cli_json(argv: list[str], capsys) -> dict:
    assert main([*argv, "--format", "json", "--extensions"]) == 0
    return json.loads(capsys.readouterr().out)


def rows_of(values) -> list:
    return values if isinstance(values[0], list) else [[x] for x in values]  # a vector: one number per row


def test_the_json_has_both_columns_and_the_difference_per_term(capsys) -> None:
    doc = cli_json(["forward", "--source", "triton"], capsys)  # the teaching example: float64, N = 6, D = 4
    pytest.importorskip("jsonschema").Draft202012Validator(schema()).validate(doc)
    assert doc["kernel"]["blockM"] == doc["kernel"]["blockN"] == 16 and "2 x 2" in doc["kernel"]["tiles"]
    assert doc["kernel"]["note"] == NOTE
    (case,) = doc["cases"]  # one 16 x 16 tile holds the whole 6 x 6 example
    assert [t["name"] for t in case["kernel"]["terms"]] == list(KERNEL_TERMS)
    for term in case["kernel"]["terms"]:
        ref, mine = ([x for row in rows_of(term[c]) for x in row] for c in ("reference", "kernel"))
        diff = max(0.0 if a == b else abs(a - b) for a, b in zip(ref, mine, strict=True))
        assert term["maxDiff"] == pytest.approx(diff, rel=1e-12, abs=0)
        assert 0 <= diff < 1e-6  # float32 kernel, float64 reference: the input rounding and a few float32 ulps
    assert "kernel" not in cli_json(["forward"], capsys)  # the reference alone: no kernel keys


def test_the_table_shows_the_kernel_panel_and_the_note(capsys) -> None:
    assert main(["forward", "--source", "triton", "--causal"]) == 0
    out = capsys.readouterr().out
    assert "Kernel (core/kernel.py) beside the reference" in out and "max |difference|" in out
    assert "S_ij (row 0)" in out and "acc_new (row 0)" in out and "exp2 and the folded scale" in out


def test_the_cli_refuses_what_the_kernel_cannot_run(capsys) -> None:
    assert main(["forward", "--source", "triton", "--order", "key_major"]) == 2
    assert 'order="query_major"' in capsys.readouterr().err


def check_terms(rows: list[dict], terms: list[dict], label) -> None:
    """The panel's ``rows`` are ``terms``' (the JSON's) row by row: each number to 8 significant digits (the
    page's), each difference the max over the row to its 3 digits; ``label(name, n)`` the n-th row's label."""
    expected = []
    for term in terms:
        for n, (r, k) in enumerate(zip(rows_of(term["reference"]), rows_of(term["kernel"]), strict=True)):
            expected.append((term["name"], str(label(term["name"], n)), r, k))
    assert [(row["term"], row["row"]) for row in rows] == [e[:2] for e in expected]
    for row, (name, _, ref, mine) in zip(rows, expected, strict=True):
        for text, values in ((row["reference"], ref), (row["kernel"], mine)):
            shown = text.split(" ")
            assert len(shown) == len(values), (name, text)
            for s, x in zip(shown, values, strict=True):
                assert (s == "\u2212\u221e") if x is None else math.isclose(float(s), x, rel_tol=1e-7, abs_tol=1e-30)
        pairs = zip(ref, mine, strict=True)
        diff = max(0.0 if a == b else (math.inf if None in (a, b) else abs(a - b)) for a, b in pairs)
        assert float(row["difference"]) == pytest.approx(diff, rel=5.01e-3, abs=1e-300), (name, row)  # 3 digits


def assert_fits_a_phone(browser, page_path, panel: str, next_id: str, clicks: int) -> None:
    """At a phone's width (390 px), after ``clicks`` of ``#next_id``, the kernel panel ``#panel`` is shown and
    nothing in it reaches past the page's width unclipped (the layout test's probe, on the panel alone)."""
    from test_trace_layout import EMPTY, OVERFLOWING

    browser.open(page_path, width=390, height=900)
    for _ in range(clicks):
        browser.evaluate(f'document.getElementById("{next_id}").click()')
    assert browser.evaluate(f'document.getElementById("{panel}").hidden') is False
    in_panel = OVERFLOWING.replace(
        'document.body.querySelectorAll("*")', f'document.getElementById("{panel}").querySelectorAll("*")'
    )
    assert in_panel != OVERFLOWING
    overflow = browser.evaluate(in_panel)
    assert not overflow["found"] and overflow["scrollWidth"] <= overflow["innerWidth"], overflow
    assert browser.evaluate(EMPTY) == []


def check_page(page: dict, case: dict, row_start: int) -> None:
    """Every number of the forward panel is the case's JSON; its rows are the query rows from ``row_start``."""
    check_terms(page["rows"], case["kernel"]["terms"], lambda _, n: row_start + n)


def test_the_page_shows_both_columns_at_every_update(browser, tmp_path, capsys) -> None:
    argv = [*MULTI.split(), "--source", "triton"]
    doc = cli_json(argv, capsys)
    assert len(doc["cases"]) == 2
    page_path = tmp_path / "kernel.html"
    assert main([*argv, "--format", "html", "--out", str(page_path)]) == 0
    browser.open(page_path)
    for n, case in enumerate(doc["cases"]):
        if n:
            browser.evaluate('document.getElementById("next").click()')
        page = browser.evaluate(READ_KERNEL)
        assert page["counter"] == f"Tile update {n + 1} of 2"
        check_page(page, case, 16)
        assert page["note"] == NOTE and "tiles 16 × 16" in page["meta"]
    # a diff that is not zero shows as one: the float32 sums differ in their last bits somewhere
    assert any(float(r["difference"]) > 0 for r in page["rows"])


def test_the_page_shows_the_production_kernels_columns(browser, tmp_path, capsys) -> None:
    """``--kernel production``: its 32 x 16 tile (the interpreter's), so query block 1 of 16 rows is the kernel's
    query block 0 (rows 0-31), two updates under causal."""
    argv = [*MULTI.split(), "--source", "triton", "--kernel", "production"]
    doc = cli_json(argv, capsys)
    assert len(doc["cases"]) == 2 and doc["kernel"]["blockM"] == 32 and "row 16" in doc["kernel"]["tiles"]
    page_path = tmp_path / "production.html"
    assert main([*argv, "--format", "html", "--out", str(page_path)]) == 0
    browser.open(page_path)
    browser.evaluate('document.getElementById("next").click()')
    page = browser.evaluate(READ_KERNEL)
    check_page(page, doc["cases"][1], 0)
    assert page["note"] == PRODUCTION_NOTE and "tiles 32 × 16" in page["meta"]


def test_the_page_of_the_reference_has_no_kernel_panel(browser, tmp_path) -> None:
    page_path = tmp_path / "reference.html"
    assert main(["forward", "--format", "html", "--out", str(page_path)]) == 0
    browser.open(page_path)
    assert browser.evaluate('document.getElementById("kernel") === null') is True


def test_the_png_lists_the_kernel_beside_the_reference(tmp_path) -> None:
    import torch

    from flashattn_teach.replay import replay
    from flashattn_teach.replay.kernel_view import kernel_lines
    from flashattn_teach.replay.png import render_png

    torch.manual_seed(0)
    q, k, v = (torch.randn(20, 16) for _ in range(3))
    r = replay(q, k, v, block_m=16, block_n=16, causal=True, query_block=1, source="triton")
    step = r.steps[0]
    lines = kernel_lines(step)
    assert len(lines) == 2 + len(KERNEL_TERMS)
    for line, name in zip(lines[2:], KERNEL_TERMS, strict=True):
        label, ref, mine, *_, diff = line.split()
        assert label == name and float(diff) == pytest.approx(step.kernel_diff[name], rel=5.01e-3, abs=1e-300)
        assert float(ref) == pytest.approx(float(step[name].reshape(-1)[0]), rel=1e-7)
        assert float(mine) == pytest.approx(float(step.kernel[name].reshape(-1)[0]), rel=1e-7)
    assert kernel_lines(replay(q, k, v, block_m=16, block_n=16).steps[0]) == []
    assert render_png(r, tmp_path / "kernel.png").stat().st_size > 0


@pytest.mark.parametrize("width", [1200, 390])
def test_the_kernel_panel_fits_the_width(browser, tmp_path, width) -> None:
    from test_trace_layout import EMPTY, OVERFLOWING

    page_path = tmp_path / "kernel.html"
    assert main([*MULTI.split(), "--source", "triton", "--format", "html", "--out", str(page_path)]) == 0
    browser.open(page_path, width=width, height=900)
    browser.press("ArrowRight")  # the second update
    assert browser.evaluate("document.getElementById('kernel-terms') !== null") is True
    # the layout test's probe, on the kernel panel alone (a 40 x 40 grid's labels reach past a phone's width)
    in_panel = OVERFLOWING.replace(
        'document.body.querySelectorAll("*")', 'document.getElementById("kernel").querySelectorAll("*")'
    )
    assert in_panel != OVERFLOWING
    overflow = browser.evaluate(in_panel)
    assert not overflow["found"], overflow
    assert browser.evaluate(EMPTY) == []
