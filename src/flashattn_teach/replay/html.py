"""A replay as one self-contained HTML page: tabs of views, each stepping through its own updates.

The page embeds ``to_experiment(replay, extensions=True)`` as JSON (``#replay-data``) and each further view's
data (``#view-data``, ``{key: payload}``), and draws them with the scripts ``page.js`` (the core: tabs,
steppers, keys) and one ``page_<view>.js`` per view, with the styles ``page.css`` and ``page_<view>.css``
(package data next to this file), all inlined; a Content-Security-Policy of ``default-src 'none'`` forbids
every network fetch. :func:`fill_page` fills that template for any page: the decode step's page
(:mod:`.decode_html`) is ``page.js`` with ``page_decode.js`` instead of the forward view.

The forward view (``page_forward.js``) renders any seed-format experiment; the extensions only add the
skipped (SKIP) tiles, each update's tile kind, which cells are masked (``visible``, added here: the page
draws every cell anyway) and, for the key-major order, the tiles of other query blocks already computed. A
replay with an attention sink also gets, per update, a labelled bar for each row's sink share so far
(``sinkShare``) next to its final share ``exp(sink_h - lse_i)``. The tile states reach the scripts as the
values of :class:`~flashattn_teach.replay.replay.TileState`, embedded next to the data.

The other views are listed in :data:`VIEWS` (:mod:`.page_views`): each names its script and style and a
builder ``build(replay, options) -> payload | None`` (None: nothing to show for this replay, no tab). The
keyword arguments of :func:`render_html` reach the builders; each view declares the ones it reads, and one
no view reads is refused.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from ..errors import AttentionValueError
from ..masks.causal import TileKind
from .manifest import to_experiment
from .page_views import VIEWS
from .replay import Replay, TileState

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


def render_html(replay: Replay, *, open_view: str | None = None, **options: Any) -> str:
    """The self-contained page for ``replay``: no network, no external script or style.

    ``open_view``: the key of the view shown first (default the forward one); ``options``: what the views of
    :data:`VIEWS` read (see each view's module), e.g. ``backward=`` a backward replay."""
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
    enums = {enum.__name__: {member.name: member.value for member in enum} for enum in (TileState, TileKind)}
    return fill_page(
        title="Tile replay",
        data=_experiment(replay, open_view),
        enums=enums,
        views=payloads,
        scripts=["page.js", "page_forward.js", *(v.script for v in VIEWS)],
        styles=["page.css", *(v.style for v in VIEWS if v.style is not None)],
        legend=legend,
    )
