"""The PNG renderer: any replay as pictures (matplotlib), through one entry point, :func:`render_png`.

One module per scenario's drawing, and one for what they share:

    forward.py    a forward replay: one row per tile update, the schedule grid, the vector bars and the
                  update's equations with their numbers (:func:`.forward.render_forward_png`)
    backward.py   a backward replay: one picture per tile step of FA2 Alg. 2's two passes, and one for the
                  preprocess and the result (:func:`.backward.render_backward_png`; :func:`.backward.tile_states`)
    decode.py     a decode step: the cache by split, the tile updates, the merges, the error
                  (:func:`.decode.render_decode_png`)
    common.py     the resolution, numbers as drawn, paled colours, the tile states' legend, text blocks, the write

Uses ``matplotlib.figure.Figure`` directly, not pyplot, so rendering never changes a notebook's backend; matplotlib
loads only when a picture is drawn.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import AttentionValueError
from ..backward_replay import BackwardReplay
from ..decode_replay import DecodeReplay
from ..replay import Replay
from .backward import render_backward_png
from .common import DPI
from .decode import render_decode_png
from .forward import render_forward_png

__all__ = ["render_png"]


def render_png(
    replay: Replay | BackwardReplay | DecodeReplay, path: str | Path, *, step: int | None = None, dpi: int = DPI
) -> Path:
    """Write ``replay`` as a PNG to ``path``: every tile update, or only update ``step`` (1-based). A decode
    step takes no ``step``; a backward replay writes ``step`` alone to ``path``, or without it the preprocess
    and the result to ``path`` and every step beside it (:func:`.backward.render_backward_png`)."""
    if isinstance(replay, BackwardReplay):
        return render_backward_png(replay, path, step=step, dpi=dpi)[0]
    if isinstance(replay, DecodeReplay):
        if step is not None:
            raise AttentionValueError("render_png() of a decode step draws the whole step: it takes no step=")
        return render_decode_png(replay, path, dpi=dpi)
    return render_forward_png(replay, path, step=step, dpi=dpi)
