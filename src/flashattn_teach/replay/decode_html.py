"""A decode-step replay as one self-contained page: every split's tile updates, the merges, the sink, the error.

The page steps through the events of :class:`~.decode_replay.DecodeReplay` in the order the decode runs them
(Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"):

1. each split's tile updates: the keys of the tile with their role (cached, new) and, in a paged cache, their
   page, block id and slot; the running ``m_i``, ``l_i`` and ``acc / l_i`` per query row, and FA2 Alg. 1's
   lines with their numbers (:func:`.equations.step_json`, the same as the prefill page's); the split's last
   update ends at its partial ``O_s = acc / l_i``, ``lse_s = m_i + log(l_i)`` (lines 12-13);
2. each merge of the running result with the next split's (:mod:`.decode_merges`), per query row::

       lse = log(exp(lse_a) + exp(lse_b)),   w_a = exp(lse_a - lse),   w_b = exp(lse_b - lse),
       O   = w_a O_a + w_b O_b

   and, with an attention sink, the last merge with ``(O_b = 0, lse_b = sink_h)``: its ``w_b`` is the sink's
   share of the row;
3. the result: the merged ``O, lse`` beside the dense float64 oracle's, and ``max |O - O_final|``.

The page is built by :func:`.html.fill_page` from ``page.js`` (the core: stepper, keys) and ``page_decode.js``;
``#replay-data`` holds :func:`.decode_manifest.decode_to_experiment` (what ``--format json`` writes) and
``#view-data`` the events drawn (:func:`build_decode_view`). ``-inf`` is ``null`` in both.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

from torch import Tensor

from ..errors import AttentionValueError
from ..masks.causal import TileKind
from .decode_manifest import decode_to_experiment, merge_json
from .decode_merges import MergeStep
from .decode_replay import DecodeReplay, KeyRole, SplitReplay
from .equations import step_json
from .html import LEGEND_COLOURS, MAX_DRAWN_CELLS, fill_page
from .manifest import json_number, json_rows, json_values
from .steps import TileState, TileStep

__all__ = ["DecodeEvent", "build_decode_view", "check_decode_drawable", "render_decode_html"]

TITLE = "Decode step replay"
SOURCE = "Dao, Haziza, Massa, Sizov 2023, Flash-Decoding (the merge of split-KV partials)"
BOTH_EMPTY = "neither side saw a key: lse = −∞, and the code subtracts 0 instead, so w_a = w_b = 0 (no −∞ − (−∞))"


class DecodeEvent(Enum):
    """One step of the decode page, in the order the decode runs them."""

    TILE = "tile"  # a tile update inside one split
    MERGE = "merge"  # a merge of two partial results (or of the sink)
    RESULT = "result"  # the merged output against the dense oracle


def check_decode_drawable(r: DecodeReplay) -> None:
    """Refuse a step whose ``N_new x N_max`` cells are more than the page draws."""
    cells = r.N_new * r.N_max
    if cells > MAX_DRAWN_CELLS:
        raise AttentionValueError(
            f"the decode page draws every cache slot for every query row, and N_new x N_max = {r.N_new} x "
            f"{r.N_max} = {cells} is more than {MAX_DRAWN_CELLS}: use a shorter cache, or the table or JSON output"
        )


def _slots(r: DecodeReplay) -> list[dict[str, Any]]:
    """Every cache slot: its role, its split and, in a paged cache, its page, block id and slot on the page."""
    slots = []
    for j in range(r.N_max):
        slot: dict[str, Any] = {"key": j, "role": r.role(j).value, "split": r.split_of(j)}
        if r.page_size is not None:
            at = r.page_of(j)  # (block id, slot), None past the element's pages
            slot.update(
                page=None if at is None else j // r.page_size,
                block=None if at is None else at[0],
                slot=None if at is None else at[1],
            )
        slots.append(slot)
    return slots


def _tile(split: SplitReplay, step: TileStep) -> dict[str, Any]:
    """A tile update of ``split`` (``step.cols`` in global key positions): the state after it, its equations."""
    event: dict[str, Any] = {
        "event": DecodeEvent.TILE.value,
        "split": split.index,
        "splitKeys": list(split.keys),
        "update": step.index + 1,
        "updates": len(split),
        "tileKind": step.kind.value,
        "cols": list(step.cols),
        "m": json_values(step.m_i),
        "l": json_values(step.l_i),
        "output": json_rows(step.O_partial),
        "maxDiff": step.max_diff,
        "equations": step_json(step),
        "last": step.last,
    }
    if step.last:  # the split's partial result, as the merges read it
        event["partial"] = {"output": json_rows(split.O_s), "lse": json_values(split.lse_s)}
    return event


def _minus(x: float) -> tuple[Any, ...]:
    """`` − x`` as parts: `` − 0`` for ``-inf`` (the code's safe subtraction), a negative ``x`` in parentheses."""
    if x == -math.inf:
        return (" − 0",)
    return (" − (", x, ")") if x < 0 else (" − ", x)


def _merge_row(m: MergeStep, O_a: Tensor, O_b: Tensor, r: int) -> list[dict[str, Any]]:
    """Row ``r``'s merge equations with their numbers, each ``{name, symbolic, parts, value, note?}``."""
    lse_a, lse_b, lse = float(m.lse_a[r]), float(m.lse_b[r]), float(m.lse[r])
    w_a, w_b = float(m.w_a[r]), float(m.w_b[r])
    a, b, out = O_a[r].tolist(), O_b[r].tolist(), m.O[r].tolist()
    note = BOTH_EMPTY if lse == -math.inf else None
    sink = m.split is None
    eqs: list[dict[str, Any]] = [
        {
            "name": "lse",
            "symbolic": "lse = log(exp(lse_a) + exp(" + ("sink_h" if sink else "lse_b") + "))",
            "parts": ["log(exp(", lse_a, ") + exp(", lse_b, ")) = ", lse],
            "value": lse,
        },
        {
            "name": "w_a",
            "symbolic": "w_a = exp(lse_a − lse)",
            "parts": ["exp(", lse_a, *_minus(lse), ") = ", w_a],
            "value": w_a,
        },
        {
            "name": "w_b",
            "symbolic": "w_b = exp(sink_h − lse), the sink's share of the row" if sink else "w_b = exp(lse_b − lse)",
            "parts": ["exp(", lse_b, *_minus(lse), ") = ", w_b],
            "value": w_b,
        },
        {
            "name": "O",
            "symbolic": "O = w_a O_a + w_b · 0" if sink else "O = w_a O_a + w_b O_b",
            "parts": [w_a, " · ", a, " + ", w_b, " · ", b, " = ", out],
            "value": out,
        },
    ]
    for eq in eqs:
        eq["parts"] = [_json_part(p) for p in eq["parts"]]
        eq["value"] = _json_part(eq["value"])
        if note is not None:
            eq["note"] = note
    return eqs


def _json_part(part: Any) -> Any:
    if isinstance(part, str):
        return part
    if isinstance(part, list):
        return [json_number(x) for x in part]
    return json_number(part)


def _merge(m: MergeStep, O_a: Tensor, O_b: Tensor) -> dict[str, Any]:
    """Merge ``m`` of ``(O_a, lse_a)`` with ``(O_b, lse_b)`` (``O_b = 0`` for the sink), per row."""
    return {
        "event": DecodeEvent.MERGE.value,
        **merge_json(m),
        "label": m.label,
        "outputA": json_rows(O_a),
        "outputB": json_rows(O_b),
        "equations": [_merge_row(m, O_a, O_b, r) for r in range(m.O.shape[0])],
    }


def _events(r: DecodeReplay) -> list[dict[str, Any]]:
    events = [_tile(split, step) for split in r.splits for step in split]
    partials = {split.index: split.O_s for split in r.splits}
    for m in r.merges:
        # O_a: the first split's partial, then the previous merge's result; O_b: the split's partial, 0 for the sink.
        O_a = partials[m.merged[0]] if m.index == 0 else r.merges[m.index - 1].O
        O_b = partials[m.split] if m.split is not None else m.O.new_zeros(m.O.shape)
        events.append(_merge(m, O_a, O_b))
    events.append(
        {
            "event": DecodeEvent.RESULT.value,
            "output": json_rows(r.O),
            "lse": json_values(r.lse),
            "denseOutput": json_rows(r.O_final),
            "denseLse": json_values(r.lse_final),
            "maxDiff": r.max_diff,
        }
    )
    return events


def build_decode_view(r: DecodeReplay) -> dict[str, Any]:
    """The decode page's payload: the step's sizes, every cache slot, and the events the page steps through."""
    return {
        "title": TITLE,
        "source": SOURCE,
        "labels": r.labels(),
        "cacheLen": r.cache_len,
        "newKeys": r.N_new_kv,
        "newQueries": r.N_new,
        "cacheSize": r.N_max,
        "keys": list(r.keys),
        "blockN": r.block_n,
        "numSplits": r.num_splits,
        "ranges": [list(keys) for keys in r.ranges],
        "scale": r.scale,
        "batchIndex": r.batch_index,
        "head": r.head,
        "pageSize": r.page_size,
        "pages": list(r.pages),
        "sink": r.sink,
        "slots": _slots(r),
        "visible": ["".join("1" if x else "0" for x in row) for row in r.visible.tolist()],
        "events": _events(r),
    }


def render_decode_html(r: DecodeReplay) -> str:
    """The self-contained page of the decode step ``r``: no network, no external script or style."""
    check_decode_drawable(r)
    enums = {enum.__name__: {m.name: m.value for m in enum} for enum in (DecodeEvent, KeyRole, TileKind, TileState)}
    legend = "".join(  # the cache strip's cells coloured as the prefill page's tiles
        f"table.dec-cache td.{s.value}, .legend i.{s.value} {{ background: {colour}; }}\n"
        for s, colour in LEGEND_COLOURS.items()
    )
    return fill_page(
        title=TITLE,
        data=decode_to_experiment(r),
        enums=enums,
        views={"decode": build_decode_view(r)},
        scripts=["page.js", "page_decode.js"],
        styles=["page.css", "page_decode.css"],
        legend=legend,
    )
