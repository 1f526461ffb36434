"""What the PNG pictures share: the resolution, a number as drawn, a paled colour, the tile states' legend, a
block of monospace text, and the write to disk.

Uses ``matplotlib.figure.Figure`` directly, not pyplot, so rendering never changes a notebook's backend;
matplotlib loads only inside these functions.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..html import LEGEND_COLOURS

DPI = 130
RGB = tuple[float, float, float]


def fmt(x: float) -> str:
    """A value as drawn: 4 significant digits, ``-inf`` as ``−∞``."""
    return "−∞" if x == -math.inf else f"{x:.4g}"


def pale(colour: str, keep: float) -> RGB:
    """``colour`` moved toward white: ``keep`` of its distance from white is left (a masked cell)."""
    from matplotlib.colors import to_rgb

    red, green, blue = to_rgb(colour)
    return 1 - keep * (1 - red), 1 - keep * (1 - green), 1 - keep * (1 - blue)


def legend_handles() -> list[Any]:
    """One patch per tile state, in :data:`.html.LEGEND_COLOURS`'s colours (the page's)."""
    from matplotlib.patches import Patch

    return [Patch(facecolor=colour, edgecolor="#888", label=s.value) for s, colour in LEGEND_COLOURS.items()]


def text_block(ax: Any, lines: list[str], points: float) -> None:
    """``lines`` in monospace from the top left of ``ax``, with no axes drawn."""
    ax.axis("off")
    ax.text(0, 1, "\n".join(lines), va="top", ha="left", fontsize=points, family="monospace", transform=ax.transAxes)


def save(fig: Any, path: str | Path, dpi: int) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    return path
