"""``DecodeReplay._repr_html_``: a decode step as a notebook cell's last expression shows the decode page, escaped
into an ``<iframe srcdoc>``, self-contained; a step too large to draw says why."""

from __future__ import annotations

import html
import json
import re

import pytest
import torch

from flashattn_teach.replay import DecodeReplay, decode_notebook_html, replay_decode
from flashattn_teach.replay.html import MAX_DRAWN_CELLS, render_decode_html
from flashattn_teach.replay.manifest import decode_to_experiment

from decode_page_cases import paged_step, sink_step

FRAME = r'<iframe title="Decode replay" sandbox="allow-scripts" style="[^"<>]*" srcdoc="([^"<>]*)"></iframe>'


@pytest.mark.parametrize("make", [sink_step, paged_step])
def test_repr_html_is_the_decode_page_escaped_in_an_iframe_srcdoc(make):
    r = make()
    frame = r._repr_html_()
    assert frame == decode_notebook_html(r)
    found = re.fullmatch(FRAME, frame)
    assert found, frame[:300]  # escaped: no quote or angle bracket inside the attribute ends it early
    page = html.unescape(found.group(1))
    assert page == render_decode_html(r)  # exactly the decode page
    data = re.search(r'<script type="application/json" id="replay-data">(.*?)</script>', page, re.S)
    assert data is not None and json.loads(data.group(1)) == json.loads(json.dumps(decode_to_experiment(r)))
    # self-contained: a policy that forbids every fetch, nothing that fetches, no URL to another origin
    assert "default-src 'none'" in page
    assert not re.search(r"<(script|img|link|iframe)[^>]*\s(src|href)=", page)
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page


def test_without_the_hook_there_is_no_rich_display(monkeypatch):
    """Negative control: the display comes from the hook the trace package installs, not from a default."""
    monkeypatch.setattr(DecodeReplay, "notebook_page", None)
    assert sink_step()._repr_html_() is None


def test_repr_html_of_a_step_too_large_to_draw_says_why():
    N_max = MAX_DRAWN_CELLS // 2 + 1  # 2 query rows x N_max cache slots: one cell too many
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 2, 4, generator=g, dtype=torch.float64)
    k_cache, v_cache = (torch.randn(1, 1, N_max, 4, generator=g, dtype=torch.float64) for _ in range(2))
    r = replay_decode(q, k_cache, v_cache, cache_seqlens=4, block_n=2, num_splits=2)
    assert r._repr_html_().startswith("<p>No decode page: the decode page draws every cache slot")
