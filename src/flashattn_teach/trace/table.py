"""A replay in the terminal (rich): per tile update the tile grid, the statistics and the shrinking error."""

from __future__ import annotations

from typing import IO

from torch import Tensor

from .manifest import span
from .replay import Replay, TileStep

# One character per tile state; the legend under each grid spells them out.
GLYPHS = {
    "current": ("■", "bold yellow"),
    "accumulated": ("▣", "green"),
    "done": ("□", "cyan"),
    "skipped": ("×", "red"),
    "pending": ("·", "dim"),
}


def _fmt(x: float) -> str:
    return "-inf" if x == float("-inf") else f"{x:.4g}"


def _row(t: Tensor) -> str:
    return "[" + ", ".join(_fmt(float(x)) for x in t.tolist()) + "]"


def _grid(replay: Replay, step: TileStep):
    from rich.text import Text

    text = Text()
    for i, row in enumerate(replay.grid(step)):
        text.append(f"i={i:<3}", style="dim")
        for state in row:
            glyph, style = GLYPHS[state]
            text.append(f" {glyph}", style=style)
        text.append("\n")
    for state, (glyph, style) in GLYPHS.items():
        text.append(f"{glyph} {state}  ", style=style)
    return text


def _stats(step: TileStep):
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("row", "S_ij (this tile)", "m_i", "l_i", "O partial = acc / l_i", "O final (dense)"):
        table.add_column(column, justify="right" if column in ("row", "m_i", "l_i") else "left")
    r0 = step.rows[0]
    for r in range(step.rows[1] - r0):
        table.add_row(
            str(r0 + r),
            _row(step.S_ij[r]),
            _fmt(float(step.m_i[r])),
            _fmt(float(step.l_i[r])),
            _row(step.O_partial[r]),
            _row(step.O_final[r]),
        )
    return table


def render_table(replay: Replay, file: IO[str] | None = None, *, width: int = 120) -> None:
    """Print ``replay`` to ``file`` (default stdout): one panel per tile update, then the error summary."""
    from rich.console import Console, Group
    from rich.panel import Panel
    from rich.table import Table

    console = Console(file=file, width=width, highlight=False)
    r0, r1 = replay.rows
    console.print(
        f"[bold]Tile replay[/bold] · {replay.order} · query block i={replay.query_block} (rows {span(r0, r1)}) · "
        f"N_q={replay.N_q}, N_k={replay.N_k} · BLOCK_M={replay.block_m}, BLOCK_N={replay.block_n} · "
        f"causal={replay.causal}" + (f" ({replay.causal_align})" if replay.causal else "")
    )
    for step in replay.steps:
        (c0, c1) = step.cols
        title = (
            f"Tile update {step.index + 1}/{len(replay.steps)} · key block j={step.j} (columns {span(c0, c1)}) · "
            f"schedule position {step.position + 1}/{len(replay.schedule)}" + (" · masked" if step.masked else "")
        )
        error = f"max |O partial - O final| over rows {span(r0, r1)}: [bold]{step.max_diff:.3e}[/bold]"
        console.print(Panel(Group(_grid(replay, step), _stats(step), error), title=title, title_align="left"))

    summary = Table(title="The error shrinks to zero at the last tile")
    for column in ("update", "key columns", "columns seen", "max difference"):
        summary.add_column(column, justify="right")
    for step in replay.steps:
        summary.add_row(str(step.index + 1), span(*step.cols), str(step.cols[1]), f"{step.max_diff:.3e}")
    console.print(summary)
    if replay.skipped:
        skipped = [f"({i}, {j})" for i, j in replay.skipped if i == replay.query_block]
        console.print(f"Causally skipped tiles (i, j) of this block: {', '.join(skipped) or 'none'}")
