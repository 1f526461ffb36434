"""A replay in a Jupyter notebook: the replay page (:func:`.html.render_html`) inside an ``<iframe srcdoc>``.

``Replay._repr_html_`` returns :func:`notebook_html`, so a :class:`~.replay.Replay` as a cell's last expression
displays its page. The page goes into the ``srcdoc`` attribute HTML-escaped (``&``, ``<``, ``>``, ``"`` and
``'``), so nothing in it can end the attribute or the iframe; ``sandbox="allow-scripts"`` runs its scripts in an
origin of their own, away from the notebook, and its Content-Security-Policy still forbids every fetch. The
replay module cannot import this one (html imports replay): the trace package's ``__init__`` installs it as
``Replay.notebook_page``.
"""

from __future__ import annotations

import html

from ..errors import AttentionValueError
from .html import render_html
from .replay import Replay

__all__ = ["FRAME_HEIGHT_PX", "notebook_html"]

FRAME_HEIGHT_PX = 760  # the forward view of the teaching example (6 tokens, 2 x 2 tiles) without scrolling


def notebook_html(replay: Replay, *, height: int = FRAME_HEIGHT_PX) -> str:
    """``replay``'s page as one ``<iframe>`` element for a notebook cell; a replay too large to draw gives a
    paragraph that says why."""
    try:
        page = render_html(replay)
    except AttentionValueError as error:
        return f"<p>No replay page: {html.escape(str(error))}</p>"
    return (
        f'<iframe title="Tile replay" sandbox="allow-scripts" style="width: 100%; height: {int(height)}px; '
        f'border: 1px solid #ccc" srcdoc="{html.escape(page, quote=True)}"></iframe>'
    )
