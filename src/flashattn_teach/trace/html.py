"""A replay as one self-contained HTML page: schedule grid, bars on one shared scale, prev/next controls.

The page embeds ``to_experiment(replay, extensions=True)`` as JSON and draws it with the script
``page.js`` and the style ``page.css`` (package data next to this file), both inlined; a
Content-Security-Policy of ``default-src 'none'`` forbids every network fetch. It renders any seed-format
experiment; the extensions only add the skipped (SKIP) tiles, each update's tile kind, which cells are
masked (``visible``, added here: the page draws every cell anyway) and, for the key-major order, the tiles
of other query blocks already computed. A replay with an attention sink also gets, per update, a labelled bar
for each row's sink share so far (``sinkShare``) next to its final share ``exp(sink_h - lse_i)``. The tile
states reach the script as the values of :class:`~flashattn_teach.trace.replay.TileState`, embedded next to the data.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from ..errors import AttentionValueError
from ..masks.causal import TileKind
from .manifest import to_experiment
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
<meta http-equiv="Content-Security-Policy"
      content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<title>Tile replay</title>
<style>{style}{legend}</style>
</head>
<body>
<h1 id="title"></h1>
<p class="meta" id="meta"></p>
<div class="controls">
  <button id="prev" type="button" aria-label="previous tile update">◀ prev</button>
  <span id="counter"></span>
  <button id="next" type="button" aria-label="next tile update">next ▶</button>
  <span class="meta">(or ← / → keys)</span>
</div>
<h2 id="case-label"></h2>
<p class="meta" id="position"></p>
<div class="layout">
  <div><svg id="grid" role="img" aria-label="schedule grid"></svg><div class="legend" id="legend"></div></div>
  <div id="vectors"></div>
  <div id="sink" hidden></div>
</div>
<h2>Metrics</h2>
<table class="metrics" id="metrics"></table>
<script type="application/json" id="replay-data">{data}</script>
<script type="application/json" id="replay-enums">{enums}</script>
<script>{script}</script>
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


def _experiment(replay: Replay) -> dict[str, Any]:
    """The experiment with its extensions, and the masked cells as one string of 0/1 per query row."""
    experiment = to_experiment(replay, extensions=True)
    experiment["replay"]["visible"] = ["".join("1" if x else "0" for x in row) for row in replay.visible().tolist()]
    return experiment


def render_html(replay: Replay) -> str:
    """The self-contained page for ``replay``: no network, no external script or style."""
    check_drawable(replay, "the HTML page")
    legend = "".join(
        f"rect.{state.value} {{ fill: {colour}; }} .legend i.{state.value} {{ background: {colour}; }}\n"
        for state, colour in LEGEND_COLOURS.items()
    )
    enums = {enum.__name__: {member.name: member.value for member in enum} for enum in (TileState, TileKind)}
    return TEMPLATE.format(
        style=_package_text("page.css"),
        legend=legend,
        data=_script_json(_experiment(replay)),
        enums=_script_json(enums),
        script=_package_text("page.js"),
    )
