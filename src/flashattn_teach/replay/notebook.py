"""A replay in a Jupyter notebook: its page inside an ``<iframe srcdoc>``.

``Replay._repr_html_`` returns :func:`notebook_html` (the replay page, :func:`.html.render_html`), and
``DecodeReplay._repr_html_`` :func:`decode_notebook_html` (the decode page, :func:`.html.render_decode_html`),
so a replay as a cell's last expression displays its page. The page goes into the ``srcdoc`` attribute HTML-escaped
(``&``, ``<``, ``>``, ``"`` and ``'``), so nothing in it can end the attribute or the iframe;
``sandbox="allow-scripts"`` runs its scripts in an origin of their own, away from the notebook, and its
Content-Security-Policy still forbids every fetch. The replay modules cannot import this one (html imports replay,
html imports decode_replay): the trace package's ``__init__`` installs these functions as
``Replay.notebook_page`` and ``DecodeReplay.notebook_page``.
"""

from __future__ import annotations

import html
from collections.abc import Callable

from ..errors import AttentionValueError
from .decode_replay import DecodeReplay
from .html import render_decode_html, render_html
from .replay import Replay

__all__ = ["FRAME_HEIGHT_PX", "decode_notebook_html", "notebook_html"]

FRAME_HEIGHT_PX = 760  # the forward view of the teaching example (6 tokens, 2 x 2 tiles) without scrolling


def _frame(render: Callable[[], str], title: str, page_name: str, height: int) -> str:
    """The page ``render()`` returns as one ``<iframe>`` element; a page too large to draw gives a paragraph
    that says why (``No <page_name> page: ...``)."""
    try:
        page = render()
    except AttentionValueError as error:
        return f"<p>No {page_name} page: {html.escape(str(error))}</p>"
    return (
        f'<iframe title="{title}" sandbox="allow-scripts" style="width: 100%; height: {int(height)}px; '
        f'border: 1px solid #ccc" srcdoc="{html.escape(page, quote=True)}"></iframe>'
    )


def notebook_html(replay: Replay, *, height: int = FRAME_HEIGHT_PX) -> str:
    """``replay``'s page as one ``<iframe>`` element for a notebook cell; a replay too large to draw gives a
    paragraph that says why."""
    return _frame(lambda: render_html(replay), "Tile replay", "replay", height)


def decode_notebook_html(replay: DecodeReplay, *, height: int = FRAME_HEIGHT_PX) -> str:
    """The decode step's page (:func:`.html.render_decode_html`) as one ``<iframe>`` element for a
    notebook cell; a step too large to draw gives a paragraph that says why."""
    return _frame(lambda: render_decode_html(replay), "Decode replay", "decode", height)
