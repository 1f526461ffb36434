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

:func:`render_table` prints any of the three scenarios, each step as its kind asks: a backward replay as its
PREPROCESS, every DKDV step, every DQ step, each a panel of its tile ``(i, j)`` and kind and its equations (FA2
Alg. 2 line, ``name = symbolic``) with their numbers, then each gradient against the float64 ``torch.autograd``
oracle; a decode step as the cache's keys, each split's UPDATEs (one row each), then its MERGEs (one row each).
Every backward and decode step is drawn (those replays are meant to be small); narrow, a row of a split's
updates or of the merges is a few labelled lines, and the cache's roles are one letter each (with a legend).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import IO, Any

from . import kernel_view_backward
from .backward_replay import BackwardReplay
from .decode_replay import DecodeReplay, KeyRole
from .equations_view import replay_equations
from .kernel_trace_decode import NOTE as DECODE_NOTE
from .kernel_view import kernel_table, kernel_text
from .kernel_view_decode import DECODE_KERNEL_SOURCE, decode_kernel_table
from .manifest import span
from .memory import memory_figure
from .memory_table import memory_panel
from .replay import Replay
from .step import Step, StepEquation, TileState, numbers
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
        cells = [str(r0 + r), numbers(step["S_ij"][r]), numbers(float(step["m_i"][r])), numbers(float(step["l_i"][r]))]
        if step.get("sink_share") is not None:
            cells.append(numbers(float(step["sink_share"][r])))
        out = [numbers(step["O_partial"][r]), numbers(step["O_final"][r])]
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
    """Print ``replay`` to ``file`` (default stdout), any scenario, ``width`` columns wide (default the
    terminal's, :mod:`.terminal`): a forward replay's tile updates, one panel each, then the error summary; a
    backward replay's steps (:func:`_backward`); a decode step's (:func:`_decode`)."""
    console = open_console(file, width)
    narrow = is_narrow(console)
    if isinstance(replay, BackwardReplay):
        return _backward(console, replay, narrow)
    if isinstance(replay, DecodeReplay):
        return _decode(console, replay, narrow)
    return _forward(console, replay, narrow)


def _forward(console: Any, replay: Replay, narrow: bool) -> None:
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

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
                    *([kernel_table(step, replay.kernel)] if step.kernel else []),
                    error,
                    memory_panel(memory, step.index, narrow=narrow),
                ),
                title=title,
                title_align="left",
            )
        )
    console.print(summary)
    if replay.source == "triton":
        console.print(kernel_text(replay))
    share = replay.sink_share()
    if share is not None:
        rows = ", ".join(f"row {r0 + r}: {numbers(float(x))}" for r, x in enumerate(share.tolist()))
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


def _backward(console: Any, br: BackwardReplay, narrow: bool) -> None:
    """The PREPROCESS, the DKDV steps, the DQ steps, the errors."""
    from rich.panel import Panel

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
            if step.kernel:  # source="triton": the kernels' numbers beside the reference's
                console.print(kernel_view_backward.kernel_table(br, step))
    console.print(_errors(br))
    worst = max(br.max_error().values())
    console.print(f"max |grad - oracle| over every gradient: [bold]{worst:.3e}[/bold]")
    if br.source == "triton":
        head = kernel_view_backward.kernel_head(br)
        moved = (
            ""
            if head["dqOrderMoves"] is None
            else f" Summed in the reverse order, dQ moves by up to {head['dqOrderMoves']:.3g}."
        )
        console.print(f"Kernels: {head['source']}. {head['tiles']} {head['note']}{moved}".replace("  ", " "))


# A decode step: the cache, each split's UPDATEs, the MERGEs. ROLE_GLYPHS: a cache slot's role, one letter narrow.
ROLE_GLYPHS = {KeyRole.OLD: ("o", "cyan"), KeyRole.NEW: ("n", "bold magenta"), KeyRole.UNUSED: (".", "dim")}
MERGES_TITLE = "Merges: lse = log(exp(lse_a) + exp(lse_b)), O = w_a O_a + w_b O_b"


def _cache(r: DecodeReplay, narrow: bool):
    """The cache's slots: role, split, and per query row which keys it sees (x) or not (.); ``narrow``: each
    role as its letter, spelt out in the table's caption."""
    from rich.table import Table

    legend = "role: " + ", ".join(f"{glyph} {role.value}" for role, (glyph, _) in ROLE_GLYPHS.items())
    table = Table(box=None, pad_edge=False, title="The cache after the step's write", caption_justify="left")
    table.caption = legend if narrow else None
    table.add_column("")
    for j in range(r.N_max):
        table.add_column(str(j), justify="center")
    glyphs = [ROLE_GLYPHS[r.role(j)] for j in range(r.N_max)]
    roles = [glyph if narrow else r.role(j).value for j, (glyph, _) in enumerate(glyphs)]
    table.add_row("role", *(f"[{style}]{text}[/]" for text, (_, style) in zip(roles, glyphs, strict=True)))
    table.add_row("split", *("·" if (s := r.split_of(j)) is None else str(s) for j in range(r.N_max)))
    if r.page_size is not None:  # paged: the block id of each key's page (slot j % page_size)
        table.add_row("page", *("·" if (at := r.page_of(j)) is None else str(at[0]) for j in range(r.N_max)))
    first = r.L - r.N_new
    for i, row in enumerate(r.visible.tolist()):
        table.add_row(f"q{i} (at {first + i})", *("x" if seen else "." for seen in row))
    return table


def _listing(columns: Sequence[str], rows: Iterable[Sequence[str]], narrow: bool, head: int, title: str = ""):
    """Steps one row each under ``columns``; narrow (80 columns), each row as lines: its first ``head`` cells on
    one line (``update 1 · key columns 0–2 · ...``), then one ``column = value`` line per other cell."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    if not narrow:
        table = Table(title=title) if title else Table(box=None, pad_edge=False)
        for column in columns:
            table.add_column(column, justify="left" if column.startswith(("S_ij", "tile")) else "right")
        for row in rows:
            table.add_row(*row)
        return table
    lines: list[Text | str] = [Text(title, style="italic")] if title else []
    for row in rows:
        first = " · ".join(f"{c} {v}" for c, v in zip(columns[1:head], row[1:head], strict=True))
        lines.append(f"{columns[0]} {row[0]}: {first}")
        lines += [f"  {c} = {v}" for c, v in zip(columns[head:], row[head:], strict=True)]
    return Group(*lines)


UPDATE_COLUMNS = ("update", "key columns", "tile", "max |O_s - O_final|", "S_ij (row-major)", "m_i", "l_i")
MERGE_COLUMNS = ("merge", "a + b", "max |O - O_final|", "lse_a", "lse_b", "lse", "w_a = exp(lse_a - lse)", "w_b")


def _update_row(step: Step) -> list[str]:
    """A split's UPDATE as one row of :data:`UPDATE_COLUMNS`."""
    tile, error = step.tile_kind.name, f"{step.max_diff:.3e}"
    head = [str(step.index + 1), span(*step.cols), tile, error]
    return [*head, numbers(step["S_ij"].reshape(-1)), numbers(step["m_i"]), numbers(step["l_i"])]


def _merge_row(m: Step) -> list[str]:
    """A MERGE as one row of :data:`MERGE_COLUMNS`."""
    head = [str(m.index + 1), m.label, f"{m.max_diff:.3e}"]
    return head + [numbers(m[name]) for name in ("lse_a", "lse_b", "lse", "w_a", "w_b")]


def _decode(console: Any, r: DecodeReplay, narrow: bool) -> None:
    """The cache, one panel per split (its UPDATEs and its partial result), the MERGEs, the final error."""
    from rich.console import Group
    from rich.panel import Panel

    console.print(
        f"[bold]Decode step replay[/bold] · batch element {r.batch_index}, query head {r.head} · "
        f"{r.cache_len} cached + {r.N_new_kv} new keys = L {r.L} of N_max {r.N_max} slots · N_new={r.N_new} "
        f"quer{'y' if r.N_new == 1 else 'ies'} · num_splits={r.num_splits}, BLOCK_N={r.block_n} · "
        + ("" if r.page_size is None else f"paged, page_size {r.page_size}, pages {list(r.pages)} · ")
        + " · ".join(r.labels() or ["no mask"])
    )
    console.print(_cache(r, narrow))
    empty = [span(a, b) if a < b else "empty" for a, b in r.ranges]
    console.print("Split ranges: " + ", ".join(f"{s}: {keys}" for s, keys in enumerate(empty)))
    for split in r.splits:
        result = f"partial result: lse_s = {numbers(split.lse_s)}, O_s row 0 = {numbers(split.O_s[0])}"
        updates = _listing(UPDATE_COLUMNS, [_update_row(step) for step in split], narrow, head=4)
        n = len(split)
        title = f"Split {split.index} · keys {span(*split.keys)} · {n} tile update{'s' * (n != 1)}"
        kernel = [decode_kernel_table(split, "Kernel (decode.py) beside the reference")] if r.kernel else []
        console.print(Panel(Group(updates, result, *kernel), title=title, title_align="left"))
    if r.merges:
        console.print(_listing(MERGE_COLUMNS, [_merge_row(m) for m in r.merges], narrow, head=3, title=MERGES_TITLE))
        if r.kernel:
            console.print(
                decode_kernel_table(r.merges, "Merges: the kernel's partials and result beside the reference")
            )
    console.print(
        f"merged O against the dense float64 output of the step: max difference [bold]{r.max_diff:.3e}[/bold]; "
        f"lse = {numbers(r.lse)} (dense {numbers(r.lse_final)})"
    )
    if r.kernel:
        console.print(f"Kernel: {DECODE_KERNEL_SOURCE}. {r.note} {DECODE_NOTE}")
