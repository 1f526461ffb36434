"""The views of the replay page beyond the forward one, in tab order (see :mod:`.html`).

Each entry names its script (``page_<key>.js``), its style and its builder, which lives in the view's own
module; a view whose builder returns None for a replay gets no tab.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .compare import build as build_compare
from .replay import Replay

Builder = Callable[[Replay, Mapping[str, Any]], "dict[str, Any] | None"]


@dataclass(frozen=True)
class View:
    """One view of the page beyond the forward one: its tab, its files and the data its script draws."""

    key: str  # the key of its payload in #view-data, and its section's id "view-<key>"
    title: str  # the tab's label
    script: str  # page_<key>.js: registers the view with Page.addView or Page.addForwardPanel
    style: str | None  # page_<key>.css, or None
    build: Builder  # (replay, options) -> the payload, or None when the view has nothing to show
    options: tuple[str, ...] = ()  # the keyword arguments of render_html the builder reads


VIEWS: tuple[View, ...] = (
    View("compare", "Side by side", "page_compare.js", "page_compare.css", build_compare, options=("compare",)),
)
