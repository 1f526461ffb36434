"""The terminal a replay's table prints to: rich's Console at the terminal's width, and the layout that fits it.

No width is forced: rich reads the terminal's (or ``COLUMNS``; 80 when neither is known, e.g. in a pipe), so an
80-column terminal gets lines of at most 80 characters rather than 120-column lines that wrap and break the
boxes. A console of :data:`WIDE` columns or more gets the side-by-side layout (an equation beside its
numbers, the on-chip buffers beside the HBM bytes); a narrower one gets the same values stacked (each equation
over its numbers, one table under the other, shorter bars). Nothing is left out of the narrow layout.
"""

from __future__ import annotations

from typing import IO, Any

WIDE = 120  # columns from which the tables sit side by side


def open_console(file: IO[str] | None, width: int | None) -> Any:
    """A rich Console writing to ``file`` (default stdout), ``width`` columns wide (default the terminal's)."""
    from rich.console import Console

    return Console(file=file, width=width, highlight=False)


def is_narrow(console: Any) -> bool:
    """Whether ``console`` is too narrow for the side-by-side layout."""
    return bool(console.width < WIDE)
