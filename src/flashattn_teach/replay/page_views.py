"""The views of the replay page beyond the forward one, in tab order (see :mod:`.html`).

Each entry names its script (``page_<key>.js``), its style and its builder, which lives in the view's own
module; a view whose builder returns None for a replay gets no tab.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .compare import build as build_compare
from .equations_view import build_view as build_equations
from .gpu_schedule import OPTIONS as GPU_OPTIONS
from .gpu_schedule import build as build_gpu
from .kernel_view import build_view as build_kernel
from .manifest import build_backward_view
from .memory import build_view as build_memory
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
    panel: bool = False  # a panel of the forward view (Page.addForwardPanel), not a tab of its own


VIEWS: tuple[View, ...] = (
    # forward panels, drawn in this order under the forward view at every tile update
    View("equations", "Equations", "page_equations.js", "page_equations.css", build_equations, panel=True),
    View("memory", "Memory", "page_memory.js", "page_memory.css", build_memory, panel=True),
    View("kernel", "Kernel", "page_kernel.js", "page_kernel.css", build_kernel, panel=True),  # source="triton"
    # tabs beside the forward view, in this order
    View("compare", "Side by side", "page_compare.js", "page_compare.css", build_compare, ("compare",)),
    View("backward", "Backward", "page_backward.js", "page_backward.css", build_backward_view, ("backward",)),
    View("gpu", "GPU schedule", "page_gpu.js", "page_gpu.css", build_gpu, GPU_OPTIONS),
)
