"""The decode step's page: its payload holds the DecodeReplay's own numbers, event by event (tile updates,
merges, sink, result), a paged cache's pages and a sink's share appear, and ``--decode --format html`` writes it.
The merge equations are checked against the merge recomputed here from its inputs."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from flashattn_teach.replay.equations import step_json
from flashattn_teach.replay.html import DecodeEvent, build_decode_view, render_decode_html
from flashattn_teach.replay.manifest import decode_to_experiment

from decode_page_cases import BLOCK_TABLE, PAGE_SIZE, paged_step, sink_step, window_step
from replay_cli import main

DECODE = "decode --seed 0 --cache-len 5 --new-kv 2 --new-queries 2 --num-splits 3 --block-n 2 --head-dim 4".split()


def values(t: torch.Tensor) -> list:
    """A tensor as the payload writes it: nested lists, -inf as None."""
    if t.dim() > 1:
        return [values(row) for row in t]
    return [None if x == -math.inf else x for x in t.tolist()]


def numbers(parts: list) -> list[float]:
    """The numbers of an equation's parts, in order (None: -inf)."""
    out: list = []
    for p in parts:
        if isinstance(p, list):
            out += [-math.inf if x is None else x for x in p]
        elif not isinstance(p, str):
            out.append(-math.inf if p is None else p)
    return out


def embedded(page: str, element: str) -> dict:
    match = re.search(rf'<script type="application/json" id="{element}">(.*?)</script>', page, re.S)
    assert match is not None, element
    return json.loads(match.group(1))


def by_kind(view: dict, event: DecodeEvent) -> list[dict]:
    return [e for e in view["events"] if e["event"] == event.value]


@pytest.mark.parametrize("make", [sink_step, paged_step, window_step])
def test_the_payload_holds_every_tile_update_merge_and_the_result_with_the_replays_numbers(make):
    r = make()
    view = build_decode_view(r)
    steps = [(split, step) for split in r.splits for step in split]
    tiles, merges = by_kind(view, DecodeEvent.TILE), by_kind(view, DecodeEvent.MERGE)
    assert [e["event"] for e in view["events"]] == ["tile"] * len(steps) + ["merge"] * len(r.merges) + ["result"]
    for e, (split, step) in zip(tiles, steps, strict=True):
        assert (e["split"], e["cols"], e["update"]) == (split.index, list(step.cols), step.index + 1)
        assert split.keys[0] <= step.cols[0] < step.cols[1] <= split.keys[1]
        assert (
            e["m"] == values(step["m_i"]) and e["l"] == values(step["l_i"]) and e["output"] == values(step["O_partial"])
        )
        assert e["equations"] == step_json(step)  # the forward panel's equations, the same numbers
        assert ("partial" in e) == step.last
        if step.last:
            assert e["partial"] == {"output": values(split.O_s), "lse": values(split.lse_s)}
    partials = {split.index: split.O_s for split in r.splits}
    for n, (e, m) in enumerate(zip(merges, r.merges, strict=True)):
        O_a = partials[m.merged[0]] if n == 0 else r.merges[n - 1]["O"]
        O_b = torch.zeros_like(m["O"]) if m.split is None else partials[m.split]
        assert (e["split"], e["merged"], e["label"]) == (m.split, list(m.merged), m.label)
        assert e["outputA"] == values(O_a) and e["outputB"] == values(O_b) and e["output"] == values(m["O"])
        for key, t in (
            ("lseA", m["lse_a"]),
            ("lseB", m["lse_b"]),
            ("lse", m["lse"]),
            ("weightA", m["w_a"]),
            ("weightB", m["w_b"]),
        ):
            assert e[key] == values(t), key
        for row, eqs in enumerate(e["equations"]):
            check_merge_row(eqs, O_a[row], O_b[row])
    (result,) = by_kind(view, DecodeEvent.RESULT)
    assert result["output"] == values(r.O) and result["denseOutput"] == values(r.O_final)
    assert result["lse"] == values(r.lse) and result["denseLse"] == values(r.lse_final)
    assert result["maxDiff"] == r.max_diff <= 1e-12
    torch.testing.assert_close(r.O, r.O_final, atol=1e-12, rtol=0)  # the step ends at the dense float64 output
    for j, slot in enumerate(view["slots"]):
        assert (slot["role"], slot["split"]) == (r.role(j).value, r.split_of(j))


def check_merge_row(eqs: list[dict], O_a: torch.Tensor, O_b: torch.Tensor) -> None:
    """One row's merge equations, recomputed from their own inputs: lse, the weights, then O."""
    by_name = {e["name"]: e for e in eqs}
    assert list(by_name) == ["lse", "w_a", "w_b", "O"]
    lse_a, lse_b, lse = numbers(by_name["lse"]["parts"])
    assert lse == (-math.inf if by_name["lse"]["value"] is None else by_name["lse"]["value"])
    if lse == -math.inf:
        assert lse_a == lse_b == -math.inf and "note" in by_name["w_a"]
    else:
        assert math.isclose(lse, math.log(math.exp(lse_a) + math.exp(lse_b)), rel_tol=1e-12, abs_tol=1e-12)
    w_a, w_b = by_name["w_a"]["value"], by_name["w_b"]["value"]
    safe = 0.0 if lse == -math.inf else lse
    assert math.isclose(w_a, math.exp(lse_a - safe), rel_tol=1e-12, abs_tol=1e-300)
    assert math.isclose(w_b, math.exp(lse_b - safe), rel_tol=1e-12, abs_tol=1e-300)
    assert numbers(by_name["w_a"]["parts"])[-1] == w_a and numbers(by_name["w_b"]["parts"])[-1] == w_b
    out = numbers(by_name["O"]["parts"])
    D = O_a.numel()
    assert out[: 1 + D] == [w_a, *O_a.tolist()] and out[1 + D : 2 + 2 * D] == [w_b, *O_b.tolist()]
    expected = [w_a * a + w_b * b for a, b in zip(O_a.tolist(), O_b.tolist(), strict=True)]
    assert out[2 + 2 * D :] == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_a_paged_cache_shows_each_keys_page_block_id_and_slot():
    r = paged_step()
    view = build_decode_view(r)
    assert view["pageSize"] == PAGE_SIZE and view["pages"] == [1, 5, 3] == BLOCK_TABLE[1, :3].tolist()
    for j, slot in enumerate(view["slots"]):
        if j < r.L:  # key j of element 1 lives on its page j // 3, block id block_table[1, j // 3], slot j % 3
            page = j // PAGE_SIZE
            assert (slot["page"], slot["block"], slot["slot"]) == (page, int(BLOCK_TABLE[1, page]), j % PAGE_SIZE)
        else:
            assert slot["page"] is slot["block"] is slot["slot"] is None
    assert "page" not in build_decode_view(sink_step())["slots"][0]  # negative control: a contiguous cache


def test_the_sink_is_merged_last_and_its_weight_is_its_share():
    r = sink_step()
    merges = by_kind(build_decode_view(r), DecodeEvent.MERGE)
    sink = merges[-1]
    assert sink["split"] is None and sink["label"] == "(0 1 2) + sink" and r.sink == 0.5
    assert sink["lseB"] == [0.5, 0.5] and sink["outputB"] == [[0.0] * 4] * 2
    share = torch.exp(torch.tensor(0.5, dtype=torch.float64) - r.lse_final)  # the oracle's sink share per row
    torch.testing.assert_close(torch.tensor(sink["weightB"], dtype=torch.float64), share, atol=1e-12, rtol=0)
    assert "sink's share" in sink["equations"][0][2]["symbolic"]
    assert all(m["split"] is not None for m in by_kind(build_decode_view(paged_step()), DecodeEvent.MERGE))


def test_a_row_without_a_key_in_a_split_has_lse_minus_infinity_and_weight_zero():
    view = build_decode_view(window_step())
    (merge,) = by_kind(view, DecodeEvent.MERGE)
    assert merge["lseA"][1] is None and merge["lseB"][0] is None  # each split leaves one row without a key
    assert merge["weightA"][1] == 0.0 and merge["weightB"][0] == 0.0


def test_the_page_embeds_the_json_and_the_events_and_fetches_nothing():
    r = paged_step()
    page = render_decode_html(r)
    assert embedded(page, "view-data") == {"decode": build_decode_view(r)}
    assert embedded(page, "replay-data") == json.loads(json.dumps(decode_to_experiment(r)))
    assert embedded(page, "replay-enums")["DecodeEvent"] == {e.name: e.value for e in DecodeEvent}
    assert "default-src 'none'" in page and "<title>Decode step replay</title>" in page
    assert not re.search(r"""(src|href)=["']https?:""", page)


def test_cli_writes_the_decode_page_with_the_json_numbers(tmp_path, capsys):
    argv = [*DECODE, "--dtype", "float64", "--sinks", "0.5"]
    assert main([*argv, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    out = tmp_path / "decode.html"
    assert main([*argv, "--format", "html", "--out", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    assert embedded(page, "replay-data") == doc
    view = embedded(page, "view-data")["decode"]
    merges = by_kind(view, DecodeEvent.MERGE)
    assert [m["weightB"] for m in merges] == [m["weightB"] for m in doc["decode"]["merges"]]
    assert by_kind(view, DecodeEvent.RESULT)[0]["maxDiff"] == doc["decode"]["maxDiff"]


def test_cli_refuses_a_page_too_large_to_draw(capsys):
    assert main([*DECODE, "--cache-len", "9000", "--format", "html"]) == 2
    assert "the decode page draws every cache slot" in capsys.readouterr().err
