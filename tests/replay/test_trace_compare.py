"""The side-by-side view's data (trace/compare.py): both orders' numbers are the replays' own, step t of each is
schedule position t, and both end at a float64 dense oracle written here; plus Replay._repr_html_."""

from __future__ import annotations

import html
import json
import math
import re

import pytest
import torch
from teaching import teaching_inputs

from flashattn_teach.errors import AttentionTypeError
from flashattn_teach.replay import notebook_html, replay
from flashattn_teach.replay.compare import DEFAULT_MAX_CELLS, build, compare_payload
from flashattn_teach.replay.html import render_html


def oracle(q, k, v, allowed=None, sink=None):
    """Dense float64 attention of batch element 0: (m, l, O) per row, with S = q k^T / sqrt(D)."""
    S = (q[0] @ k[0].T) / math.sqrt(q.shape[-1])  # (N_q, D) @ (D, N_k) -> (N_q, N_k)
    if allowed is not None:
        S = S.masked_fill(~allowed, -math.inf)
    if sink is not None:  # one extra key of score sink and value 0
        S = torch.cat([S, torch.full((S.shape[0], 1), sink, dtype=S.dtype)], dim=1)
        v = torch.cat([v[0], torch.zeros(1, v.shape[-1], dtype=v.dtype)])[None]
    m = S.amax(dim=1)
    m0 = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    P = torch.exp(S - m0[:, None])
    l = P.sum(dim=1)
    O = torch.where(l[:, None] > 0, (P @ v[0]) / l.clamp_min(1e-300)[:, None], torch.zeros(1, dtype=S.dtype))
    return m, l, O


def view_keys(page: str) -> set[str]:
    """The views the page embeds data for (html.py's #view-data)."""
    found = re.search(r'<script type="application/json" id="view-data">(.*?)</script>', page, flags=re.DOTALL)
    assert found
    return set(json.loads(found.group(1)))


def f64(values):
    return torch.tensor(values, dtype=torch.float64)


def as_tensor(values):
    return torch.tensor([-math.inf if x is None else x for x in values], dtype=torch.float64)


def final_rows(updates, n_rows, initial):
    """Every row's (m, l, O) after the last update of its block (initial state for a block never updated)."""
    m = [initial["m"]] * n_rows
    l = [initial["l"]] * n_rows
    O: list[list[float] | None] = [None] * n_rows
    for u in updates:
        for k, r in enumerate(range(*u["rows"])):
            m[r], l[r], O[r] = u["m"][k], u["l"][k], u["O"][k]
    return m, l, O


@pytest.mark.parametrize("name", ["teaching", "causal-sink", "row-without-keys"])
def test_compare_numbers_are_the_replays_own_and_end_at_the_dense_oracle(name):
    q, k, v = teaching_inputs()
    kwargs: dict = {}
    allowed, sink = None, None
    if name == "causal-sink":
        allowed, sink = torch.ones(6, 6, dtype=torch.bool).tril(), 0.5
        kwargs = {"causal": True, "sinks": sink}
    if name == "row-without-keys":  # row 3 sees no key
        allowed = torch.ones(6, 6, dtype=torch.bool)
        allowed[3] = False
        kwargs = {"attn_mask": allowed}
    r = replay(q, k, v, block_m=2, block_n=2, **kwargs)
    payload = json.loads(json.dumps(compare_payload(r), allow_nan=False))  # what the page embeds
    assert [o["order"] for o in payload["orders"]] == ["query_major", "key_major"]
    L = payload["length"]
    tiles = {}
    for o in payload["orders"]:
        updates = o["updates"]
        assert [u["position"] for u in updates] == list(range(L))  # step t of each order is position t
        tiles[o["order"]] = sorted((u["i"], u["j"]) for u in updates)
        for t, u in enumerate(updates):  # the numbers of the replay of that order and block, update by update
            steps = list(r.with_options(order=o["order"], query_block=u["i"]).steps)
            step = next(s for s in steps if s.j == u["j"])
            assert step.position == t and list(step.rows) == u["rows"]
            assert torch.equal(as_tensor(u["m"]), step["m_i"]) and torch.equal(f64(u["l"]), step["l_i"])
            assert torch.equal(f64(u["O"]), step["O_partial"])
    assert tiles["query_major"] == tiles["key_major"]  # the same tiles, each once
    order_of = {o["order"]: [(u["i"], u["j"]) for u in o["updates"]] for o in payload["orders"]}
    assert order_of["query_major"] == sorted(order_of["query_major"])  # for i, for j
    assert order_of["key_major"] == sorted(order_of["key_major"], key=lambda t: (t[1], t[0]))  # for j, for i

    m, l, O = oracle(q, k, v, allowed, sink)
    dense = payload["dense"]
    assert torch.allclose(as_tensor(dense["m"]), m, rtol=0, atol=1e-12)
    assert torch.allclose(f64(dense["l"]), l, rtol=0, atol=1e-12)
    assert torch.allclose(f64(dense["O"]), O, rtol=0, atol=1e-12)
    lse = torch.where(l > 0, m + torch.log(l), torch.tensor(-math.inf, dtype=torch.float64))
    assert torch.allclose(as_tensor(dense["lse"]), lse, rtol=0, atol=1e-12)
    for o in payload["orders"]:  # both orders end at the oracle, row by row
        fm, fl, fO = final_rows(o["updates"], 6, payload["initial"])
        assert torch.allclose(as_tensor(fm), m, rtol=0, atol=1e-12), o["order"]
        assert torch.allclose(f64(fl), l, rtol=0, atol=1e-12), o["order"]
        got = torch.tensor([row if row is not None else [0.0] * 4 for row in fO], dtype=torch.float64)
        assert torch.allclose(got, O, rtol=0, atol=1e-12), o["order"]
    if name == "row-without-keys":  # -inf - -inf handled: m stays -inf (null), l = 0, O = 0
        assert dense["m"][3] is None and dense["l"][3] == 0 and dense["O"][3] == [0.0] * 4


def test_halfway_the_orders_differ_from_dense_and_each_other():
    """Negative control: the probe above sees a partial state; halfway neither order has every row final."""
    q, k, v = teaching_inputs()
    payload = compare_payload(replay(q, k, v, block_m=2, block_n=2))
    _, _, O = oracle(q, k, v)
    t = payload["length"] // 2  # 4 of 9 tiles done after update 4
    states = {}
    for o in payload["orders"]:
        _, _, fO = final_rows(o["updates"][: t + 1], 6, payload["initial"])
        states[o["order"]] = fO
        final = [
            row is not None and torch.allclose(torch.tensor(row, dtype=torch.float64), O[r]) for r, row in enumerate(fO)
        ]
        assert not all(final), o["order"]
    # query-major: blocks 0 finished, block 1 partial, block 2 untouched; key-major: every block touched
    assert states["query_major"][5] is None and all(row is not None for row in states["key_major"])


def test_compare_is_built_by_default_only_for_small_replays():
    small = replay(*teaching_inputs(), block_m=2, block_n=2)
    large = replay(*teaching_inputs(80, 80), block_m=16, block_n=16)
    assert large.N_q * large.N_k > DEFAULT_MAX_CELLS >= small.N_q * small.N_k
    assert build(small, {}) is not None and build(large, {}) is None
    assert build(large, {"compare": True}) is not None
    assert build(small, {"compare": False}) is None
    with pytest.raises(AttentionTypeError, match="compare must be"):
        build(small, {"compare": "yes"})
    assert "compare" in view_keys(render_html(small)) and "compare" not in view_keys(render_html(small, compare=False))


def test_repr_html_is_the_page_escaped_in_an_iframe_srcdoc():
    r = replay(*teaching_inputs(), block_m=2, block_n=2, causal=True)
    frame = r._repr_html_()
    assert frame == notebook_html(r)
    found = re.fullmatch(
        r'<iframe title="Tile replay" sandbox="allow-scripts" style="[^"<>]*" srcdoc="([^"<>]*)"></iframe>', frame
    )
    assert found, frame[:300]  # escaped: no quote or angle bracket inside the attribute ends it early
    page = html.unescape(found.group(1))
    assert page == render_html(r)  # exactly the page, with every view
    assert "default-src 'none'" in page and "compare" in view_keys(page)
    # self-contained: nothing that fetches (no src/href attributes, no URL to another origin)
    assert not re.search(r"<(script|img|link|iframe)[^>]*\s(src|href)=", page)
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page


def test_repr_html_of_a_replay_too_large_to_draw_says_why():
    q, k, v = (torch.randn(1, 200, 2, dtype=torch.float64) for _ in range(3))
    r = replay(q, k, v, block_m=64, block_n=64)
    assert r._repr_html_().startswith("<p>No replay page: the HTML page draws every score cell")


READ_COMPARE = """(() => Object.fromEntries([...document.querySelectorAll("#view-compare .compare-column")].map(c => [
  c.dataset.order, {
    rows: [...c.querySelectorAll("tbody tr")].map(tr => [...tr.cells].map(td => td.textContent)),
    inTile: [...c.querySelectorAll("tbody tr.in-tile")].map(tr => Number(tr.dataset.row)),
    states: Object.fromEntries([...c.querySelectorAll("rect")].map(
      e => [e.dataset.i + "," + e.dataset.j, e.dataset.state])),
  }])))()"""


def shown(text: str) -> float | None:
    return None if text in ("\u2212\u221e", "\u2014") else float(text)


def assert_row_shows(cells: list[str], m, l, O) -> None:
    """One table row: row, m_i, l_i, O[0..D_v), then the gap; four significant digits (Page.fmt)."""
    assert shown(cells[1]) is None if m is None else math.isclose(shown(cells[1]), m, rel_tol=5.01e-4)
    assert math.isclose(float(cells[2]), l, rel_tol=5.01e-4, abs_tol=1e-300)
    for text, x in zip(cells[3:-1], O if O is not None else [None] * len(cells[3:-1]), strict=True):
        assert shown(text) is None if x is None else math.isclose(shown(text), x, rel_tol=5.01e-4, abs_tol=1e-12)


def test_the_page_steps_both_orders_together_and_shows_the_payloads_numbers(browser, tmp_path):
    q, k, v = teaching_inputs()
    r = replay(q, k, v, block_m=2, block_n=2, causal=True)
    payload = compare_payload(r)
    path = tmp_path / "compare.html"
    path.write_text(render_html(r, open_view="compare"), encoding="utf-8")
    browser.open(path, width=1200)
    for t in range(payload["length"]):
        page = browser.evaluate(READ_COMPARE)
        for o in payload["orders"]:
            shown_order = page[o["order"]]
            now = o["updates"][t]
            assert shown_order["inTile"] == list(range(*now["rows"])), (o["order"], t)
            assert shown_order["states"][f"{now['i']},{now['j']}"] == "current"
            for i, j in payload["skipped"]:
                assert shown_order["states"][f"{i},{j}"] == "skipped"
            m, l, O = final_rows(o["updates"][: t + 1], 6, payload["initial"])
            for r_, cells in enumerate(shown_order["rows"]):
                assert cells[0] == str(r_)
                assert_row_shows(cells, m[r_], l[r_], O[r_])
        dense = payload["dense"]
        for r_, cells in enumerate(page["dense"]["rows"]):
            assert_row_shows(cells, dense["m"][r_], dense["l"][r_], dense["O"][r_])
            assert cells[-1] == "0.0e+0"  # dense against itself
        browser.press("ArrowRight")
    assert page["query_major"]["rows"] == page["key_major"]["rows"]  # both end at the same numbers ...
    assert [row[:-1] for row in page["query_major"]["rows"]] == [
        row[:-1] for row in page["dense"]["rows"]
    ]  # ... dense's


def test_the_dense_target_reads_the_block_mask_and_the_score_mod():
    """The dense target's m, l and lse with FlexAttention's mask_mod and score_mod, against the scores written
    out here; a negative control shows the block mask changes them (so the target could not ignore it)."""
    from flashattn_teach import create_block_mask

    def prefix_lm(b, h, q_idx, kv_idx):  # the first 2 keys seen by every query, causal after them
        return (kv_idx < 2) | (kv_idx <= q_idx)

    def distance(score, b, h, q_idx, kv_idx):  # a relative-position bias
        return score - 0.25 * (q_idx - kv_idx).abs()

    q, k, v = teaching_inputs(N_q=6, N_k=6)
    bm = create_block_mask(prefix_lm, None, None, 6, 6, device="cpu", BLOCK_SIZE=2)
    payload = compare_payload(replay(q, k, v, block_m=2, block_n=2, block_mask=bm, score_mod=distance))
    i, j = torch.arange(6).unsqueeze(-1), torch.arange(6).unsqueeze(0)
    S = q[0] @ k[0].T / 2 - 0.25 * (i - j).abs()  # scale 1/sqrt(4)
    S = S.masked_fill(~prefix_lm(0, 0, i, j), -math.inf)
    m = S.amax(dim=-1)
    l = torch.exp(S - m.unsqueeze(-1)).sum(dim=-1)
    dense = payload["dense"]
    torch.testing.assert_close(as_tensor(dense["m"]), m, rtol=0, atol=1e-12)
    torch.testing.assert_close(as_tensor(dense["l"]), l, rtol=0, atol=1e-12)
    torch.testing.assert_close(as_tensor(dense["lse"]), m + torch.log(l), rtol=0, atol=1e-12)
    plain = compare_payload(replay(q, k, v, block_m=2, block_n=2, score_mod=distance))["dense"]
    assert (as_tensor(plain["l"]) - l).abs().max() > 1e-3  # without the mask the target differs
