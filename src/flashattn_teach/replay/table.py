"""A replay in the terminal (rich): per tile update the tile grid, the statistics and the shrinking error.

Each update also lists FA2 Alg. 1's equations with their numbers (:mod:`.equations`): the block's first row in
full, one compact line (``alpha``, ``l_new``, at the end ``lse_i``) per other row. A key-major replay lists FA1
Alg. 1's instead (:func:`.equations_key_major.replay_equations`: the HBM loads and writes, the two rescale
factors and ``l_new`` in the compact lines).

With an attention sink, each update's statistics gain a column, the sink's share of each row so far, and the
summary ends with each row's final share ``exp(sink_h - lse_i)``.

A long replay stays readable: a grid of more than ``GRID_ROWS x GRID_COLS`` tiles is drawn as a window
of that size around the current tile, and of more than ``2 * SHOWN_AT_EACH_END`` updates only the first
and last ``SHOWN_AT_EACH_END`` are drawn (every update is still computed; ``--format json`` lists them all).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import IO

from torch import Tensor

from .equations_key_major import replay_equations
from .manifest import span
from .memory import memory_figure
from .memory_table import memory_panel
from .replay import Replay, TileState, TileStep

# One character per tile state; the legend under each grid spells them out.
GLYPHS = {
    TileState.CURRENT: ("■", "bold yellow"),
    TileState.ACCUMULATED: ("▣", "green"),
    TileState.DONE: ("□", "cyan"),
    TileState.SKIPPED: ("×", "red"),
    TileState.PENDING: ("·", "dim"),
}
GRID_ROWS, GRID_COLS = 16, 48  # the largest grid drawn whole, in tiles
SHOWN_AT_EACH_END = 10  # updates drawn at the start and at the end of a long replay
SINK_COLUMN = "sink share"  # exp(sink_h - m_i) / l_i: the sink's weight in the row so far


def _fmt(x: float) -> str:
    return "-inf" if x == float("-inf") else f"{x + 0.0:.4g}"  # -0.0 + 0.0 = +0.0: no "-0"


def _row(t: Tensor) -> str:
    return "[" + ", ".join(_fmt(float(x)) for x in t.tolist()) + "]"


def _window(centre: int, size: int, total: int) -> range:
    """At most ``size`` consecutive indices of ``range(total)``, ``centre`` among them."""
    start = min(max(0, centre - size // 2), max(0, total - size))
    return range(start, min(total, start + size))


def _grid(replay: Replay, step: TileStep):
    from rich.text import Text

    rows, cols = _window(step.i, GRID_ROWS, replay.T_r), _window(step.j, GRID_COLS, replay.T_c)
    text = Text()
    if len(rows) < replay.T_r or len(cols) < replay.T_c:
        text.append(
            f"query blocks i = {span(rows.start, rows.stop)} of {replay.T_r}, "
            f"key blocks j = {span(cols.start, cols.stop)} of {replay.T_c}\n",
            style="dim",
        )
    width = max(3, len(str(rows.stop - 1)))
    for i in rows:
        text.append(f"i={i:<{width}}", style="dim")
        for j in cols:
            glyph, style = GLYPHS[replay.state(step, (i, j))]
            text.append(f" {glyph}", style=style)
        text.append("\n")
    for state, (glyph, style) in GLYPHS.items():
        text.append(f"{glyph} {state.value}  ", style=style)
    return text


def _stats(step: TileStep):
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    columns = ["row", "S_ij (this tile)", "m_i", "l_i", "O partial = acc / l_i", "O final (dense)"]
    if step.sink_share is not None:
        columns.insert(4, SINK_COLUMN)
    for column in columns:
        table.add_column(column, justify="right" if column in ("row", "m_i", "l_i", SINK_COLUMN) else "left")
    r0 = step.rows[0]
    for r in range(step.rows[1] - r0):
        cells = [str(r0 + r), _row(step.S_ij[r]), _fmt(float(step.m_i[r])), _fmt(float(step.l_i[r]))]
        if step.sink_share is not None:
            cells.append(_fmt(float(step.sink_share[r])))
        table.add_row(*cells, _row(step.O_partial[r]), _row(step.O_final[r]))
    return table


def _equations(replay: Replay, step: TileStep):
    """Row ``r0``'s equations in full, then one compact line per other row of the block."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    shown = replay_equations(replay, step)
    r0 = shown.row_start
    title = f"{shown.algorithm} with the numbers of row {r0}"
    table = Table(box=None, pad_edge=False, title=title, title_justify="left")
    for column in ("line", "equation", f"row {r0}"):
        table.add_column(column, justify="right" if column == "line" else "left")
    for e in shown.rows[0] if shown.rows else ():
        table.add_row(str(e.line), Text(e.symbolic), Text(e.substituted + (f"  ({e.note})" if e.note else "")))
    others = [Text(f"row {r0 + r}: {shown.compact(r)}") for r in range(1, len(shown.rows))]
    return Group(table, *others)


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
        + " · ".join(replay.labels() or ["no mask"])
    )
    summary = Table(title="The error shrinks to zero at the last tile")
    for column in ("update", "key columns", "columns seen", "max difference"):
        summary.add_column(column, justify="right")
    total = len(replay.steps)
    hidden = range(SHOWN_AT_EACH_END, total - SHOWN_AT_EACH_END)  # empty unless the replay is long
    memory = memory_figure(replay)  # sizes and positions only: no tile update runs
    seen = 0  # key columns of the tiles visited so far (with a window, not all columns before this tile)
    for step in replay.steps:  # computed as they come, so one pass draws the panels and fills the summary
        (c0, c1) = step.cols
        seen += c1 - c0
        if step.index in hidden:
            if step.index == hidden.start:
                console.print(f"… tile updates {hidden.start + 1}–{hidden.stop} of {total} not drawn …")
                summary.add_row("…", "…", "…", "…")
            continue
        summary.add_row(str(step.index + 1), span(c0, c1), str(seen), f"{step.max_diff:.3e}")
        title = (
            f"Tile update {step.index + 1}/{total} · key block j={step.j} (columns {span(c0, c1)}) · "
            f"schedule position {step.position + 1}/{len(replay.schedule)} · {step.kind.name} tile"
            + (" (masked)" if step.masked else "")
        )
        error = f"max |O partial - O final| over rows {span(r0, r1)}: [bold]{step.max_diff:.3e}[/bold]"
        console.print(
            Panel(
                Group(
                    _grid(replay, step),
                    _stats(step),
                    _equations(replay, step),
                    error,
                    memory_panel(memory, step.index),
                ),
                title=title,
                title_align="left",
            )
        )
    console.print(summary)
    share = replay.sink_share()
    if share is not None:
        rows = ", ".join(f"row {r0 + r}: {_fmt(float(x))}" for r, x in enumerate(share.tolist()))
        console.print(
            f"Sink share at the end, exp(sink - lse_i) with sink = {replay.sink:g} (the keys hold 1 - share): {rows}"
        )
    if replay.skipped:
        runs = _runs(replay.schedule.skipped_key_blocks(replay.query_block))
        skipped = "key blocks j = " + ", ".join(span(a, b) for a, b in runs) if runs else "none"
        console.print(f"Skipped (SKIP) tiles of this block: {skipped}")


def _runs(js: Iterable[int]) -> list[tuple[int, int]]:
    """Increasing ``js`` as half-open runs of consecutive blocks: ``0 1 2 5 6`` -> ``[(0, 3), (5, 7)]``."""
    runs: list[tuple[int, int]] = []
    for j in js:
        if runs and runs[-1][1] == j:
            runs[-1] = (runs[-1][0], j + 1)
        else:
            runs.append((j, j + 1))
    return runs
