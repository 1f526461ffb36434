"""A replay as one self-contained HTML page: tabs of views, each stepping through its own updates.

The page embeds ``to_experiment(replay, extensions=True)`` as JSON (``#replay-data``) and each further view's
data (``#view-data``, ``{key: payload}``), and draws them with the scripts ``page.js`` (the core: tabs,
steppers, keys) and one ``page_<view>.js`` per view, with the styles ``page.css`` and ``page_<view>.css``
(package data next to this file), all inlined; a Content-Security-Policy of ``default-src 'none'`` forbids
every network fetch. :func:`fill_page` fills that template for any page: the decode step's page
(:func:`render_decode_html`, below) is ``page.js`` with ``page_decode.js`` instead of the forward view (and
``page_kernel.js``, whose renderer draws the decode kernel's numbers with ``source="triton"``).
:func:`render_html` draws any of the three scenarios: a forward replay (its page, the backward a tab of it),
a backward one (the same page opened on its Backward tab) or a decode step.

The forward view (``page_forward.js``) renders any seed-format experiment; the extensions only add the
skipped (SKIP) tiles, each update's tile kind, which cells are masked (``visible``, added here: the page
draws every cell anyway) and, for the key-major order, the tiles of other query blocks already computed. A
replay with an attention sink also gets, per update, a labelled bar for each row's sink share so far
(``sinkShare``) next to its final share ``exp(sink_h - lse_i)``. The tile states reach the scripts as the
values of :class:`~flashattn_teach.replay.step.TileState`, embedded next to the data.

The other views are listed in :data:`VIEWS` (:mod:`.page_views`): each names its script and style and a
builder ``build(replay, options) -> payload | None`` (None: nothing to show for this replay, no tab). The
keyword arguments of :func:`render_html` reach the builders; each view declares the ones it reads, and one
no view reads is refused.
"""

from __future__ import annotations

import json
import math
from enum import Enum
from importlib import resources
from typing import Any

from torch import Tensor

from ..errors import AttentionValueError
from ..masks.causal import TileKind
from .decode_replay import DecodeReplay, KeyRole, SplitReplay
from .equations import step_json
from .kernel_view import kernel_case
from .kernel_view_decode import decode_kernel_head
from .manifest import decode_to_experiment, json_number, json_rows, json_values, merge_json, to_experiment
from .page_views import VIEWS
from .replay import Replay
from .step import Step, TileState

__all__ = ["DecodeEvent", "build_decode_view", "check_decode_drawable", "render_decode_html", "render_html"]

LEGEND_COLOURS = {
    TileState.CURRENT: "#f4b400",
    TileState.ACCUMULATED: "#4caf50",
    TileState.DONE: "#9ecae1",
    TileState.SKIPPED: "#c9c9c9",
    TileState.PENDING: "#fff",
}
# A picture draws every score cell: the page one SVG rectangle per cell, the PNG one pixel block per cell.
MAX_DRAWN_CELLS = 128 * 128

TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy"
      content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<title>{title}</title>
<style>{style}{legend}</style>
</head>
<body>
<h1 id="title"></h1>
<p class="meta" id="meta"></p>
<nav class="tabs" role="tablist" id="tabs" aria-label="views"></nav>
<main id="views"></main>
<script type="application/json" id="replay-data">{data}</script>
<script type="application/json" id="replay-enums">{enums}</script>
<script type="application/json" id="view-data">{views}</script>
<script>{script}
Page.start();</script>
</body>
</html>
"""


def check_drawable(replay: Replay, picture: str) -> None:
    """Refuse a replay whose ``N_q x N_k`` cells are too many for ``picture`` to draw."""
    cells = replay.N_q * replay.N_k
    if cells > MAX_DRAWN_CELLS:
        raise AttentionValueError(
            f"{picture} draws every score cell, and N_q x N_k = {replay.N_q} x {replay.N_k} = {cells} is more "
            f"than {MAX_DRAWN_CELLS}: use a shorter sequence, or the table or JSON output"
        )


def _package_text(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def _script_json(obj: object) -> str:
    # "</" inside a <script> element would end it early; "<\/" is the same JSON string.
    return json.dumps(obj, ensure_ascii=False, allow_nan=False).replace("</", "<\\/")


def fill_page(
    *,
    title: str,
    data: object,
    enums: object,
    views: object,
    scripts: list[str],
    styles: list[str],
    legend: str = "",
) -> str:
    """:data:`TEMPLATE` filled: ``data``, ``enums`` and ``views`` as the JSON of ``#replay-data``,
    ``#replay-enums`` and ``#view-data``; ``scripts`` and ``styles`` the package files inlined in order
    (``page.js`` first: the core every view's script registers with); ``legend`` extra CSS rules."""
    return TEMPLATE.format(
        title=title,
        style="\n".join(_package_text(name) for name in styles),
        legend=legend,
        data=_script_json(data),
        enums=_script_json(enums),
        views=_script_json(views),
        script="\n".join(_package_text(name) for name in scripts),
    )


def _experiment(replay: Replay, open_view: str | None) -> dict[str, Any]:
    """The experiment with its extensions, and the masked cells as one string of 0/1 per query row."""
    experiment = to_experiment(replay, extensions=True)
    experiment["replay"]["visible"] = ["".join("1" if x else "0" for x in row) for row in replay.visible().tolist()]
    if open_view is not None:
        experiment["openView"] = open_view
    return experiment


def render_html(replay: Replay | DecodeReplay, *, open_view: str | None = None, **options: Any) -> str:
    """The self-contained page for ``replay``: no network, no external script or style.

    ``open_view``: the key of the view shown first (default the forward one); ``options``: what the views of
    :data:`VIEWS` read (see each view's module), e.g. ``backward=`` a backward replay. A decode step's page
    takes neither."""
    if isinstance(replay, DecodeReplay):
        if open_view is not None or options:
            raise AttentionValueError("render_html() of a decode step takes no open_view or view options")
        return render_decode_html(replay)
    check_drawable(replay, "the HTML page")
    known = {name for view in VIEWS for name in view.options}
    unknown = sorted(set(options) - known)
    if unknown:
        raise AttentionValueError(f"render_html() has no option {unknown[0]!r}; the views read {sorted(known)}")
    keys = ["forward", *(view.key for view in VIEWS if not view.panel)]  # the tabs
    if open_view is not None and open_view not in keys:
        raise AttentionValueError(f"open_view must be one of {keys}, got {open_view!r}")
    payloads = {}
    for view in VIEWS:
        payload = view.build(replay, {name: options[name] for name in view.options if name in options})
        if payload is not None:
            payloads[view.key] = payload
    if open_view not in (None, "forward", *payloads):
        raise AttentionValueError(f"open_view={open_view!r}: that view has nothing to show for this replay")
    legend = "".join(
        f"rect.{state.value} {{ fill: {colour}; }} .legend i.{state.value} {{ background: {colour}; }}\n"
        for state, colour in LEGEND_COLOURS.items()
    )
    # a masked cell is its tile's colour, pale (rect.masked in page.css): the legend's swatch, the current tile's
    legend += f".legend i.masked {{ background: {LEGEND_COLOURS[TileState.CURRENT]}; opacity: .35; }}\n"
    enums = {enum.__name__: {member.name: member.value for member in enum} for enum in (TileState, TileKind)}
    return fill_page(
        title=f"Tile replay: forward, query block i = {replay.query_block}",  # page.js: the shown view's title
        data=_experiment(replay, open_view),
        enums=enums,
        views=payloads,
        scripts=["page.js", "page_forward.js", *(v.script for v in VIEWS)],
        styles=["page.css", *(v.style for v in VIEWS if v.style is not None)],
        legend=legend,
    )


# The decode step's page (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"): the
# events of a DecodeReplay in the order the decode runs them: each split's tile updates (keys with their role and,
# paged, their page and slot; m_i, l_i, acc / l_i and FA2 Alg. 1's lines, as the prefill page), each merge
# (lse = log(exp(lse_a) + exp(lse_b)), w_a = exp(lse_a - lse), w_b = exp(lse_b - lse), O = w_a O_a + w_b O_b; the
# sink last, (O_b = 0, lse_b = sink_h)), then the result against the dense float64 oracle. #replay-data holds
# decode_to_experiment (what --format json writes), #view-data the events drawn (build_decode_view).

DECODE_TITLE = "Decode step replay"
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


def _tile(split: SplitReplay, step: Step) -> dict[str, Any]:
    """A tile update of ``split`` (``step.cols`` in global key positions): the state after it, its equations."""
    event: dict[str, Any] = {
        "event": DecodeEvent.TILE.value,
        "split": split.index,
        "splitKeys": list(split.keys),
        "update": step.index + 1,
        "updates": len(split),
        "tileKind": step.tile_kind.value,
        "cols": list(step.cols),
        "m": json_values(step["m_i"]),
        "l": json_values(step["l_i"]),
        "output": json_rows(step["O_partial"]),
        "maxDiff": step.max_diff,
        "equations": step_json(step),
        "last": step.last,
    }
    if step.last:  # the split's partial result, as the merges read it
        event["partial"] = {"output": json_rows(split.O_s), "lse": json_values(split.lse_s)}
    if step.kernel:  # source="triton": the kernel's terms beside the reference's (a merge's come with merge_json)
        event["kernel"] = kernel_case(step)
    return event


def _minus(x: float) -> tuple[Any, ...]:
    """`` − x`` as parts: `` − 0`` for ``-inf`` (the code's safe subtraction), a negative ``x`` in parentheses."""
    if x == -math.inf:
        return (" − 0",)
    return (" − (", x, ")") if x < 0 else (" − ", x)


def _merge_row(m: Step, O_a: Tensor, O_b: Tensor, r: int) -> list[dict[str, Any]]:
    """Row ``r``'s merge equations with their numbers, each ``{name, symbolic, parts, value, note?}``."""
    lse_a, lse_b, lse = float(m["lse_a"][r]), float(m["lse_b"][r]), float(m["lse"][r])
    w_a, w_b = float(m["w_a"][r]), float(m["w_b"][r])
    a, b, out = O_a[r].tolist(), O_b[r].tolist(), m["O"][r].tolist()
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


def _merge(m: Step, O_a: Tensor, O_b: Tensor) -> dict[str, Any]:
    """Merge ``m`` of ``(O_a, lse_a)`` with ``(O_b, lse_b)`` (``O_b = 0`` for the sink), per row."""
    return {
        "event": DecodeEvent.MERGE.value,
        **merge_json(m),
        "label": m.label,
        "outputA": json_rows(O_a),
        "outputB": json_rows(O_b),
        "equations": [_merge_row(m, O_a, O_b, r) for r in range(m["O"].shape[0])],
    }


def _events(r: DecodeReplay) -> list[dict[str, Any]]:
    events = [_tile(split, step) for split in r.splits for step in split]
    partials = {split.index: split.O_s for split in r.splits}
    for m in r.merges:
        # O_a: the first split's partial, then the previous merge's result; O_b: the split's partial, 0 for the sink.
        O_a = partials[m.merged[0]] if m.index == 0 else r.merges[m.index - 1]["O"]
        O_b = partials[m.split] if m.split is not None else m["O"].new_zeros(m["O"].shape)
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
    """The decode page's payload: the step's sizes, every cache slot, and the events the page steps through;
    with ``source="triton"`` the kernel's head too (``"kernel"``, its terms in each event's ``"kernel"``)."""
    view: dict[str, Any] = {
        "title": DECODE_TITLE,
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
    return view | ({"kernel": decode_kernel_head(r)} if r.source == "triton" else {})


def render_decode_html(r: DecodeReplay) -> str:
    """The self-contained page of the decode step ``r``: no network, no external script or style."""
    check_decode_drawable(r)
    enums = {enum.__name__: {m.name: m.value for m in enum} for enum in (DecodeEvent, KeyRole, TileKind, TileState)}
    legend = "".join(  # the cache strip's cells coloured as the prefill page's tiles
        f"table.dec-cache td.{s.value}, .legend i.{s.value} {{ background: {colour}; }}\n"
        for s, colour in LEGEND_COLOURS.items()
    )
    return fill_page(
        title=DECODE_TITLE,
        data=decode_to_experiment(r),
        enums=enums,
        views={"decode": build_decode_view(r)},
        scripts=["page.js", "page_kernel.js", "page_decode.js"],  # page_kernel.js: the kernel's panel's renderer
        styles=["page.css", "page_decode.css", "page_kernel.css"],
        legend=legend,
    )
