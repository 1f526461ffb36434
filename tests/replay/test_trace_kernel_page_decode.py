"""``flashattn-teach replay decode --source triton``: the decode page's kernel panel in a real headless Chromium at
every split update and merge, its numbers the JSON's (``--format json`` of the same call); a page of the reference
alone has no such panel; the PNG's lines under the tables, per update and merge, and a picture unlike the
reference's."""

from __future__ import annotations

import json
import struct

import pytest

pytest.importorskip("triton")

import torch
from test_trace_kernel_page import assert_fits_a_phone, check_terms, read_panel

from flashattn_teach.replay import replay_decode
from flashattn_teach.replay.kernel_trace_decode import NOTE

from replay_cli import main

# 82 keys in 16-key blocks, 3 splits of two blocks each (two updates a split), 2 merges; 2 query rows
ARGS = "decode --cache-len 80 --new-kv 2 --new-queries 2 --num-splits 3 --block-n 16 --source triton"
READ = read_panel("dec-kernel", "dec-kernel-terms", "dec-counter")


def test_every_update_and_merge_shows_the_kernels_numbers_of_the_json(browser, tmp_path, capsys) -> None:
    assert main([*ARGS.split(), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    merges = doc["decode"]["merges"]
    assert len(doc["cases"]) == 6 and len(merges) == 2 and doc["kernel"]["note"] == NOTE
    page_path = tmp_path / "decode.html"
    assert main([*ARGS.split(), "--format", "html", "--out", str(page_path)]) == 0
    browser.open(page_path)
    events = [("tile", c["kernel"]) for c in doc["cases"]] + [("merge", m["kernel"]) for m in merges]
    differences = []
    for n, (event, kernel) in enumerate([*events, ("result", None)]):
        if n:
            browser.evaluate('document.getElementById("dec-next").click()')
        page = browser.evaluate(READ)
        assert page["counter"] == f"Event {n + 1} of {len(events) + 1}"
        assert browser.evaluate('document.getElementById("view-decode").dataset.event') == event
        if kernel is None:  # the result: no kernel panel
            assert page["hidden"] is True
            continue
        assert page["hidden"] is False and page["note"] == NOTE
        assert "BLOCK_N 16, 3 splits: keys 0–31, 32–63, 64–81" in page["meta"]
        check_terms(page["rows"], kernel["terms"], lambda _, r: f"q{r}")
        differences += [float(row["difference"]) for row in page["rows"]]
    assert {"O", "lse"} <= {t["name"] for t in merges[-1]["kernel"]["terms"]}  # the kernel's merged O and lse
    assert max(differences) > 0  # a float32 kernel against a float64 reference: a difference shows as one
    assert_fits_a_phone(browser, page_path, "dec-kernel", "dec-next", len(events) - 1)


def test_the_decode_page_of_the_reference_has_no_kernel_panel(browser, tmp_path) -> None:
    page_path = tmp_path / "reference.html"
    assert main([*ARGS.replace(" --source triton", "").split(), "--format", "html", "--out", str(page_path)]) == 0
    browser.open(page_path)
    assert browser.evaluate('document.getElementById("view-decode").dataset.event') == "tile"
    assert browser.evaluate('document.getElementById("dec-kernel") === null') is True


def png_size(path) -> tuple[int, int]:
    width, height = struct.unpack(">II", path.read_bytes()[16:24])  # the IHDR chunk
    return width, height


def test_the_png_lists_the_kernel_under_the_tables(tmp_path) -> None:
    from flashattn_teach.replay.kernel_view_decode import decode_kernel_lines
    from flashattn_teach.replay.png import render_png

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 16) for n in (2, 2, 2))
    k_cache, v_cache = torch.randn(1, 1, 44, 16), torch.randn(1, 1, 44, 16)
    options = {"cache_seqlens": 40, "block_n": 16, "num_splits": 2, "causal": True}
    traced = replay_decode(q, k_cache, v_cache, k, v, **options, source="triton")
    reference = replay_decode(q, k_cache, v_cache, k, v, **options)
    steps = [*(s for split in traced.splits for s in split), *traced.merges]
    blocks = decode_kernel_lines(traced)
    assert len(blocks) == len(steps) == 4 and decode_kernel_lines(reference) == []
    assert [b[0] for b in blocks] == [
        "split 0 · update 1",
        "split 0 · update 2",
        "split 1 · update 1",
        "merge 1 · (0) + 1",
    ]
    for block, step in zip(blocks, steps, strict=True):
        assert [line.split()[0] for line in block[1:]] == list(step.kernel)
        for line, name in zip(block[1:], step.kernel, strict=True):
            _, ref, mine, *_, diff = line.split()
            assert float(ref) == pytest.approx(float(step[name].reshape(-1)[0]), rel=1e-7)
            assert float(mine) == pytest.approx(float(step.kernel[name].reshape(-1)[0]), rel=1e-7)
            a, b = step[name].double(), step.kernel[name].double()
            largest = torch.where(a == b, 0.0, (a - b).abs()).max()  # a masked score: -inf in both counts 0
            assert float(diff) == pytest.approx(float(largest), rel=5.01e-3, abs=1e-300)
    with_kernel = render_png(traced, tmp_path / "triton.png")
    alone = render_png(reference, tmp_path / "reference.png")
    assert with_kernel.read_bytes() != alone.read_bytes()
    (w1, h1), (w0, h0) = png_size(with_kernel), png_size(alone)
    assert w1 == w0 and h1 > h0  # the kernel's lines under the tables: a taller picture of the same width
