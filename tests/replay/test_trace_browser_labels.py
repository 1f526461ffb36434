"""The page's heading names every masking option as the table and the PNG do (``Replay.labels()``, carried in
the JSON extensions' ``"labels"``), in headless Chromium, and the JSON's labels validate against the schema."""

from __future__ import annotations

import io

import pytest
import torch

from flashattn_teach import create_block_mask
from flashattn_teach.replay import replay, to_experiment
from flashattn_teach.replay.html import render_html
from flashattn_teach.replay.manifest import schema
from flashattn_teach.replay.table import render_table


def teaching_inputs():
    torch.manual_seed(0)
    return tuple(torch.randn(1, 6, 4, dtype=torch.float64) for _ in range(3))


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < 2) | (q_idx >= kv_idx)


def labelled_replay():
    q, k, v = teaching_inputs()
    return replay(q, k, v, block_m=2, block_n=2, query_block=2, causal=True, window=(2, 0), softcap=30.0, sinks=1.0)


def flex_replay():
    q, k, v = teaching_inputs()
    bm = create_block_mask(prefix_lm, None, None, 6, 6, device="cpu", BLOCK_SIZE=2)
    return replay(q[0], k[0], v[0], block_m=2, block_n=2, query_block=2, block_mask=bm)


def test_the_json_extensions_carry_the_labels_and_validate():
    jsonschema = pytest.importorskip("jsonschema")
    r = labelled_replay()
    # Written out here: the labels the table's heading prints.
    want = ["causal (top_left)", "window (2, 0)", "softcap 30", "sink 1"]
    assert r.labels() == want
    experiment = to_experiment(r, extensions=True)
    assert experiment["replay"]["labels"] == want
    jsonschema.Draft202012Validator(schema()).validate(experiment)
    out = io.StringIO()
    render_table(r, out, width=200)
    assert " · ".join(want) in out.getvalue().splitlines()[0]
    experiment["replay"].pop("labels")  # negative control: the schema requires them
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema()).validate(experiment)


@pytest.mark.parametrize("make", [labelled_replay, flex_replay], ids=["causal-window-softcap-sink", "block_mask"])
def test_the_page_heading_shows_every_label(make, browser, tmp_path):
    r = make()
    labels = r.labels()
    assert len(labels) >= 1
    path = tmp_path / "labels.html"
    path.write_text(render_html(r), encoding="utf-8")
    browser.open(path)
    meta = browser.evaluate('document.getElementById("meta").textContent')
    assert meta.startswith(f"{r.order} order · query block {r.query_block} · BLOCK_M=2, BLOCK_N=2")
    assert meta.endswith("".join(f" · {label}" for label in labels)), meta
    for label in labels:
        assert f" · {label}" in meta
