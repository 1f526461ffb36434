"""A replay in the terminal (rich): per tile update the tile grid, the statistics and the shrinking error.

Each update also lists FA2 Alg. 1's equations with their numbers (:mod:`.equations`): the block's first row in
full, one compact line (``alpha``, ``l_new``, at the end ``lse_i``) per other row. A key-major replay lists FA1
Alg. 1's instead (:func:`.equations_view.replay_equations`: the HBM loads and writes, the two rescale
factors and ``l_new`` in the compact lines).

With an attention sink, each update's statistics gain a column, the sink's share of each row so far, and the
summary ends with each row's final share ``exp(sink_h - lse_i)``.

A long replay stays readable: a grid of more than ``GRID_ROWS x GRID_COLS`` tiles is drawn as a window
of that size around the current tile, and of more than ``2 * SHOWN_AT_EACH_END`` updates only the first
and last ``SHOWN_AT_EACH_END`` are drawn (every update is still computed; ``--format json`` lists them all).

The table takes the terminal's width (:mod:`.terminal`); below :data:`~.terminal.WIDE` columns each update
is stacked: the statistics over the outputs, each equation over its numbers, the memory's two tables one
under the other, and a grid window of at most ``GRID_COLS_NARROW`` key blocks.

:func:`render_table` prints any of the three scenarios: a backward replay (below) as the preprocess, every
dK/dV step, every dQ step, each a panel of its tile ``(i, j)`` and kind and its equations (FA2 Alg. 2 line,
``name = symbolic``) with their numbers, then each gradient against the float64 ``torch.autograd`` oracle
(every step drawn: a backward replay is meant to be small); a decode step by :mod:`.decode_table`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import IO

from torch import Tensor

from .backward_replay import BackwardReplay
from .decode_replay import DecodeReplay
from .equations_view import replay_equations
from .manifest import span
from .memory import memory_figure
from .memory_table import memory_panel
from .replay import Replay
from .step import Step, StepEquation, TileState
from .terminal import is_narrow, open_console

# One character per tile state; the legend under each grid spells them out.
GLYPHS = {
    TileState.CURRENT: ("■", "bold yellow"),
    TileState.ACCUMULATED: ("▣", "green"),
    TileState.DONE: ("□", "cyan"),
    TileState.SKIPPED: ("×", "red"),
    TileState.PENDING: ("·", "dim"),
}
GRID_ROWS, GRID_COLS = 16, 48  # the largest grid drawn whole, in tiles
GRID_COLS_NARROW = 32  # key blocks of the grid in a narrow terminal: 2 characters each
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


def _grid(replay: Replay, step: Step, narrow: bool):
    from rich.text import Text

    rows = _window(step.i, GRID_ROWS, replay.T_r)
    cols = _window(step.j, GRID_COLS_NARROW if narrow else GRID_COLS, replay.T_c)
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


def _stats(step: Step, narrow: bool):
    """Per row of the block: ``S_ij``, ``m_i``, ``l_i`` (the sink's share) and the outputs; narrow, the
    outputs as a second table under the first."""
    from rich.console import Group
    from rich.table import Table

    stats = ["row", "S_ij (this tile)", "m_i", "l_i", *([SINK_COLUMN] if step.get("sink_share") is not None else [])]
    outputs = ["O partial = acc / l_i", "O final (dense)"]
    tables = [Table(box=None, pad_edge=False)] if not narrow else [Table(box=None, pad_edge=False) for _ in "so"]
    columns = [stats + outputs] if not narrow else [stats, ["row", *outputs]]
    for table, names in zip(tables, columns, strict=True):
        for column in names:
            table.add_column(column, justify="right" if column in ("row", "m_i", "l_i", SINK_COLUMN) else "left")
    r0 = step.rows[0]
    for r in range(step.rows[1] - r0):
        cells = [str(r0 + r), _row(step["S_ij"][r]), _fmt(float(step["m_i"][r])), _fmt(float(step["l_i"][r]))]
        if step.get("sink_share") is not None:
            cells.append(_fmt(float(step["sink_share"][r])))
        out = [_row(step["O_partial"][r]), _row(step["O_final"][r])]
        if narrow:
            tables[0].add_row(*cells)
            tables[1].add_row(str(r0 + r), *out)
        else:
            tables[0].add_row(*cells, *out)
    return Group(*tables)


def _equations(replay: Replay, step: Step, narrow: bool):
    """Row ``r0``'s equations in full (narrow: each over its numbers), then one compact line per other row."""
    from rich.console import Group
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    shown = replay_equations(replay, step)
    r0 = shown.row_start
    title = f"{shown.algorithm} with the numbers of row {r0}"
    table = Table(box=None, pad_edge=False, title=title, title_justify="left")
    for column in ("line", "equation") if narrow else ("line", "equation", f"row {r0}"):
        table.add_column(column, justify="right" if column == "line" else "left")
    for e in shown.rows[0] if shown.rows else ():
        numbers = Text(e.substituted + (f"  ({e.note})" if e.note else ""))
        if narrow:
            table.add_row(str(e.line), Text(e.symbolic))
            table.add_row("", Padding(numbers, (0, 0, 0, 2)))  # indented, wrapped lines too
        else:
            table.add_row(str(e.line), Text(e.symbolic), numbers)
    others = [Text(f"row {r0 + r}: {shown.compact(r)}") for r in range(1, len(shown.rows))]
    return Group(table, *others)


def render_table(
    replay: Replay | BackwardReplay | DecodeReplay, file: IO[str] | None = None, *, width: int | None = None
) -> None:
    """Print ``replay`` to ``file`` (default stdout): one panel per tile update, then the error summary (a
    backward replay: :func:`render_backward_table`; a decode step: :func:`.decode_table.render_decode_table`);
    ``width`` columns wide (default the terminal's, :mod:`.terminal`)."""
    if isinstance(replay, BackwardReplay):
        return render_backward_table(replay, file, width=width)
    if isinstance(replay, DecodeReplay):
        from .decode_table import render_decode_table  # it imports this module's neighbours only: no cycle

        return render_decode_table(replay, file, width=width)
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    console = open_console(file, width)
    narrow = is_narrow(console)
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
        where = f"key block j={step.j} (columns {span(c0, c1)})"
        position = f"schedule position {step.position + 1}/{len(replay.schedule)}"
        kind = f"{step.tile_kind.name} tile" + (" (masked)" if step.masked else "")
        # narrow: a title that fits 80 columns, the tile's place as the panel's first line
        title = " · ".join([f"Tile update {step.index + 1}/{total}", *([] if narrow else [where, position]), kind])
        error = f"max |O partial - O final| over rows {span(r0, r1)}: [bold]{step.max_diff:.3e}[/bold]"
        console.print(
            Panel(
                Group(
                    *([f"{where} · {position}"] if narrow else []),
                    _grid(replay, step, narrow),
                    _stats(step, narrow),
                    _equations(replay, step, narrow),
                    error,
                    memory_panel(memory, step.index, narrow=narrow),
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


# The backward replay: the preprocess, every dK/dV step, every dQ step, then the errors. Below WIDE columns
# each equation's numbers go under it, indented, and a step's rows and columns under its panel's title.


def _backward_equations(eqs: Sequence[StepEquation], narrow: bool):
    """One row per equation: line, ``name = symbolic``, the numbers; ``narrow``: the numbers on the next row."""
    from rich.padding import Padding
    from rich.table import Table

    table = Table(box=None, pad_edge=False, show_header=True)
    table.add_column("line", justify="right", style="dim")
    table.add_column("equation, then with the numbers" if narrow else "equation", overflow="fold")
    if not narrow:
        table.add_column("with the numbers", overflow="fold")
    for eq in eqs:
        line, equation = "" if eq.line is None else str(eq.line), f"{eq.name} = {eq.symbolic}"
        if narrow:
            table.add_row(line, equation)
            table.add_row("", Padding(eq.substituted, (0, 0, 0, 2)))  # indented, wrapped lines too
        else:
            table.add_row(line, equation, eq.substituted)
    return table


def _step_panel(step: Step, count: int, narrow: bool):
    from rich.console import Group
    from rich.panel import Panel

    (r0, r1), (c0, c1) = step.rows, step.cols
    where = f"query rows {span(r0, r1)} · key columns {span(c0, c1)}"
    head = f"{step.step_kind.title} · step {step.index + 1} of {count} · tile (i={step.i}, j={step.j})"
    if narrow:  # a title that fits 80 columns; the rows and columns as the panel's first line
        body = Group(where, _backward_equations(step.equations, narrow))
        return Panel(body, title=f"{head} · {step.tile_kind.name}", title_align="left")
    title = f"{head} · {where} · {step.tile_kind.name}"
    return Panel(_backward_equations(step.equations, narrow), title=title, title_align="left")


def _errors(br: BackwardReplay):
    from rich.table import Table

    table = Table(title="Gradients against float64 torch.autograd of dense attention")
    for column in ("gradient", "shape", "max |grad - oracle|"):
        table.add_column(column, justify="right")
    mine = br.gradients()
    for name, error in br.max_error().items():
        table.add_row(name, "x".join(map(str, mine[name].shape)), f"{error:.3e}")
    return table


def render_backward_table(br: BackwardReplay, file: IO[str] | None = None, *, width: int | None = None) -> None:
    """Print ``br`` to ``file`` (default stdout): preprocess, the dK/dV steps, the dQ steps, the errors;
    ``width`` columns wide (default the terminal's, :mod:`.terminal`)."""
    from rich.panel import Panel

    console = open_console(file, width)
    narrow = is_narrow(console)
    N_q, N_k = br.q.shape[0], br.k.shape[0]
    extras = [f"softcap {br.softcap:g}"] if br.softcap is not None else []
    extras += [f"sink {float(br.sink[0]):g}"] if br.sink is not None else []
    console.print(
        f"[bold]Backward replay[/bold] (FlashAttention-2 Alg. 2) · batch element {br.batch_index} · N_q={N_q}, "
        f"N_k={N_k} · BLOCK_M={br.block_m}, BLOCK_N={br.block_n} · scale {br.scale:.4g}"
        + "".join(f" · {x}" for x in extras)
    )
    skipped = br.skipped()
    if skipped:
        console.print("SKIP tiles (never computed): " + ", ".join(f"({i}, {j})" for i, j in skipped))
    console.print(Panel(_backward_equations(br.preprocess().equations, narrow), title="Preprocess", title_align="left"))
    for steps in (list(br.dkdv_steps()), list(br.dq_steps())):
        for step in steps:
            console.print(_step_panel(step, len(steps), narrow))
    console.print(_errors(br))
    worst = max(br.max_error().values())
    console.print(f"max |grad - oracle| over every gradient: [bold]{worst:.3e}[/bold]")
