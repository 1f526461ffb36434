"""A replay as a picture (matplotlib): one row per tile update, the schedule grid next to the vector bars.

Next to each drawn update, its equations with their numbers (FA2 Alg. 1; a key-major replay's FA1 Alg. 1,
:func:`.equations_view.replay_equations`): the block's first row in full, one compact line per other row.

With an attention sink, each update's title gives every row's sink share so far, ``exp(sink_h - m_i) / l_i``
(at the last update the final ``exp(sink_h - lse_i)``), and the heading names the sink.

A decode step (below): the ``N_new x N_max`` scores of the step coloured by split (pale where masked, grey where
the slot is unused), the key roles above and the tiles inside each split, a paged cache's page boundaries and
block ids; then each split's tile updates (``m_i``, ``l_i``, the error) and the merges (``lse_a``, ``lse_b``,
``lse``, the weights); right, the error after every event on a log scale. A backward replay:
:mod:`.backward_png`, one picture per step. :func:`render_png` draws any of the three.

Uses ``matplotlib.figure.Figure`` directly, not pyplot, so rendering never changes a notebook's backend.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from torch import Tensor

from ..errors import AttentionValueError
from .backward_replay import BackwardReplay
from .decode_replay import DecodeReplay, KeyRole
from .equations_view import replay_equations
from .html import LEGEND_COLOURS, check_drawable
from .kernel_view import kernel_lines
from .manifest import span
from .replay import Replay
from .step import Step, TileState

VECTOR_COLOURS = ("#7f7f7f", "#d62728", "#9467bd", "#1f77b4", "#2ca02c")
RGB = tuple[float, float, float]


def _vectors(step: Step) -> list[tuple[str, Tensor]]:
    """The bars of one update, labelled in the paper's notation."""
    r0 = step.rows[0]
    return [
        ("S_ij (row-major)", step["S_ij"].reshape(-1)),
        ("m_i", step["m_i"]),
        ("l_i", step["l_i"]),
        (f"O partial, query {r0}", step["O_partial"][0]),
        (f"O final, query {r0}", step["O_final"][0]),
    ]


def _cell_colour(states: list[list[TileState]], visible: list[list[bool]], replay: Replay, r: int, c: int) -> RGB:
    from matplotlib.colors import to_rgb

    state = states[r // replay.block_m][c // replay.block_n]
    red, green, blue = to_rgb(LEGEND_COLOURS[state])
    if state is not TileState.SKIPPED and not visible[r][c]:  # a masked cell of a visited tile: pale
        return 1 - 0.4 * (1 - red), 1 - 0.4 * (1 - green), 1 - 0.4 * (1 - blue)
    return red, green, blue


def _grid(ax: Any, replay: Replay, step: Step, visible: list[list[bool]], legend: bool) -> None:
    from matplotlib.patches import Patch

    states = replay.grid(step)
    image = [[_cell_colour(states, visible, replay, r, c) for c in range(replay.N_k)] for r in range(replay.N_q)]
    ax.imshow(image, extent=(-0.5, replay.N_k - 0.5, replay.N_q - 0.5, -0.5), interpolation="nearest")
    for r in (*range(0, replay.N_q, replay.block_m), replay.N_q):  # tile boundaries
        ax.axhline(r - 0.5, color="#222", lw=1.5)
    for c in (*range(0, replay.N_k, replay.block_n), replay.N_k):
        ax.axvline(c - 0.5, color="#222", lw=1.5)
    ax.set_xticks(range(replay.N_k))
    ax.set_yticks(range(replay.N_q))
    ax.tick_params(labelsize=7, length=0)
    ax.set_xlabel("key column", fontsize=8)
    ax.set_ylabel("query row", fontsize=8)
    if legend:
        handles = [Patch(facecolor=colour, edgecolor="#888", label=s.value) for s, colour in LEGEND_COLOURS.items()]
        ax.legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(0, -0.25), ncol=3, frameon=False)


def _bars(ax: Any, step: Step, limit: float) -> None:
    labels, values, colours = [], [], []
    for (label, vector), colour in zip(_vectors(step), VECTOR_COLOURS, strict=True):
        for k, x in enumerate(vector.tolist()):
            labels.append(f"{label} [{k}]" if k == 0 else f"[{k}]")
            values.append(x)
            colours.append(colour)
    y = range(len(values))
    ax.barh(y, [x if math.isfinite(x) else 0.0 for x in values], color=colours)
    for yy, x in zip(y, values, strict=True):
        text = "−∞" if x == -math.inf else f"{x:.4g}"
        ax.text(limit * 1.02, yy, text, va="center", fontsize=6, family="monospace")
    ax.set_yticks(list(y), labels, fontsize=6)
    ax.invert_yaxis()
    ax.axvline(0, color="#444", lw=0.8)
    ax.set_xlim(-limit, limit)
    ax.tick_params(axis="x", labelsize=6)
    (r0, r1), (c0, c1) = step.rows, step.cols
    title = f"query rows {r0}–{r1 - 1} · key columns {c0}–{c1 - 1}  ·  max |O partial - O final|: {step.max_diff:.3g}"
    if step.get("sink_share") is not None:
        shares = ", ".join(f"row {r0 + r} {x:.4g}" for r, x in enumerate(step["sink_share"].tolist()))
        title += f"\nsink share so far, exp(sink − m_i) / l_i: {shares}"
    ax.set_title(title, fontsize=8, loc="left")


def _equations(ax: Any, text: list[str]) -> None:
    ax.axis("off")
    ax.text(0, 1, "\n".join(text), va="top", ha="left", fontsize=6, family="monospace", transform=ax.transAxes)


def render_png(
    replay: Replay | BackwardReplay | DecodeReplay, path: str | Path, *, step: int | None = None, dpi: int = 130
) -> Path:
    """Write ``replay`` as a PNG to ``path``: every tile update, or only update ``step`` (1-based). A decode
    step takes no ``step``; a backward replay writes ``step`` alone to ``path``, or without it the preprocess
    and the result to ``path`` and every step beside it (:func:`.backward_png.render_backward_png`)."""
    from matplotlib.figure import Figure

    if isinstance(replay, BackwardReplay):
        from .backward_png import render_backward_png  # it imports html, as this module does: no cycle

        return render_backward_png(replay, path, step=step, dpi=dpi)[0]
    if isinstance(replay, DecodeReplay):
        if step is not None:
            raise AttentionValueError("render_png() of a decode step draws the whole step: it takes no step=")
        return render_decode_png(replay, path, dpi=dpi)

    check_drawable(replay, "the PNG picture")
    total = len(replay.steps)
    if step is not None and not 1 <= step <= total:
        raise AttentionValueError(f"step must be in [1, {total}], got {step}")
    if total == 0:
        raise AttentionValueError("the replayed query block sees no key, so there is no tile update to draw")
    drawn = [s for s in replay.steps if step is None or s.index == step - 1]
    # One scale for all bars of all updates, as on the HTML page.
    limit = max(
        (abs(x) for s in replay.steps for _, v in _vectors(s) for x in v.tolist() if math.isfinite(x)),
        default=1.0,
    )
    limit = 1.0 if limit == 0 or not math.isfinite(limit) else limit * 1.05
    n_bars = sum(v.numel() for _, v in _vectors(drawn[0]))
    equations = {s.index: replay_equations(replay, s).lines() + kernel_lines(s) for s in drawn}
    n_lines = max(len(text) for text in equations.values())
    row_height = max(2.6, 0.14 * n_bars + 0.6, 0.11 * n_lines + 0.4)
    fig = Figure(figsize=(17, row_height * len(drawn) + 0.6), layout="constrained")
    axes = fig.subplots(len(drawn), 3, squeeze=False, width_ratios=(1, 2.4, 3.2))
    visible = replay.visible().tolist()
    for row, ((ax_grid, ax_bars, ax_equations), s) in enumerate(zip(axes, drawn, strict=True)):
        _grid(ax_grid, replay, s, visible, legend=row == 0)
        ax_grid.set_title(f"update {s.index + 1} of {total} · {s.tile_kind.name} tile (j={s.j})", fontsize=8)
        _bars(ax_bars, s, limit)
        _equations(ax_equations, equations[s.index])
    fig.suptitle(
        f"Tile replay · {replay.order} · query block {replay.query_block} · BLOCK_M={replay.block_m}, "
        f"BLOCK_N={replay.block_n}" + "".join(f" · {label}" for label in replay.labels()),
        fontsize=10,
    )
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    return path


# A decode step: the cache by split, the tile updates, the merges, the error.


SPLIT_COLOURS = ("#8dd3c7", "#fdb462", "#bebada", "#fb8072", "#80b1d3", "#b3de69", "#fccde5", "#bc80bd")
UNUSED_COLOUR = "#e0e0e0"
ROLE_COLOURS = {KeyRole.OLD: "#333333", KeyRole.NEW: "#c2185b", KeyRole.UNUSED: "#999999"}
PAGE_COLOUR = "#1565c0"  # a paged cache: page boundaries and each slot's block id
MAX_DRAWN_KEYS = 48  # one column per cache slot, with its label
MAX_DRAWN_ROWS = 40  # table rows: tile updates and merges
FLOOR = 1e-18  # an error of exactly 0 drawn on the log scale


def _fmt(x: float) -> str:
    return "−∞" if x == float("-inf") else f"{x:.4g}"


def _vec(t: Tensor) -> str:
    return ", ".join(_fmt(float(x)) for x in t.tolist())


def _pale(colour: str) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb

    return tuple(1 - 0.3 * (1 - c) for c in to_rgb(colour))  # type: ignore[return-value]


def _cache(ax: Any, r: DecodeReplay) -> None:
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Rectangle

    visible = r.visible.tolist()
    image = []
    for i in range(r.N_new):
        row = []
        for j in range(r.N_max):
            s = r.split_of(j)
            colour = UNUSED_COLOUR if s is None else SPLIT_COLOURS[s % len(SPLIT_COLOURS)]
            row.append(to_rgb(colour) if visible[i][j] or s is None else _pale(colour))
        image.append(row)
    ax.imshow(image, extent=(-0.5, r.N_max - 0.5, r.N_new - 0.5, -0.5), interpolation="nearest", aspect="auto")
    for i in range(r.N_new):
        for j in range(r.N_max):
            if r.split_of(j) is not None and not visible[i][j]:
                ax.text(
                    j, i, "masked", ha="center", va="center", fontsize=8, color="#444", bbox={"fc": "white", "lw": 0}
                )
    for s0, s1 in r.ranges:
        for c in range(s0, s1, r.block_n):  # tiles inside the split
            ax.axvline(c - 0.5, color="#555", lw=0.8, ls=":")
        if s0 < s1:
            ax.axvline(s0 - 0.5, color="#111", lw=2.5)
            ax.axvline(s1 - 0.5, color="#111", lw=2.5)
    ax.set_yticks(range(r.N_new), [f"q{i} (at {r.L - r.N_new + i})" for i in range(r.N_new)], fontsize=9)
    for j in range(r.cache_len, r.L):  # the keys this step wrote: hatched
        ax.add_patch(
            Rectangle(
                (j - 0.5, -0.5),
                1,
                r.N_new,
                fill=False,
                hatch="//",
                edgecolor=ROLE_COLOURS[KeyRole.NEW],
                lw=0,
                alpha=0.5,
            )
        )
    if r.page_size is not None:  # paged: a dashed line where each of the element's pages starts
        for p in range(len(r.pages) + 1):
            ax.axvline(p * r.page_size - 0.5, color=PAGE_COLOUR, lw=1.5, ls="--")
    ax.set_xticks(range(r.N_max), [slot_label(r, j) for j in range(r.N_max)], fontsize=8)
    ax.xaxis.tick_top()
    for tick, j in zip(ax.xaxis.get_major_ticks(), range(r.N_max), strict=True):
        tick.label2.set_color(ROLE_COLOURS[r.role(j)])
    ax.tick_params(length=0)
    for s, (s0, s1) in enumerate(r.ranges):
        if s0 < s1:
            label = f"split {s}: keys {span(s0, s1)}"
            ax.text((s0 + s1 - 1) / 2, r.N_new - 0.5 + 0.12, label, ha="center", va="top", fontsize=9)
    paged = "" if r.page_size is None else f"; dashed: pages of {r.page_size} slots, p = block id"
    ax.set_title(
        f"cache slots: {r.cache_len} old (cached before) · {r.N_new_kv} new (written this step) · "
        f"{r.N_max - r.L} unused  —  dotted: BLOCK_N={r.block_n} tiles; bold: split boundaries; pale: masked{paged}",
        fontsize=9,
        loc="left",
        pad=28 if r.page_size is None else 38,
    )


def slot_label(r: DecodeReplay, j: int) -> str:
    """Slot ``j``'s tick: its position and role, and in a paged cache the block id of its page."""
    label = f"{j}\n{r.role(j).value}"
    if r.page_size is None:
        return label
    at = r.page_of(j)
    return label + ("\n·" if at is None else f"\np{at[0]}")


def _table(ax: Any, header: list[str], rows: list[list[str]], title: str) -> None:
    ax.axis("off")
    ax.set_title(title, fontsize=9, loc="left")
    table = ax.table(cellText=rows, colLabels=header, loc="upper left", cellLoc="right", colLoc="right")
    table.auto_set_font_size(False)
    table.set_fontsize(8)
    table.auto_set_column_width(list(range(len(header))))
    for (row, _), cell in table.get_celld().items():
        cell.set_height(1 / (len(rows) + 1.5))
        cell.set_edgecolor("#ccc")
        if row == 0:
            cell.set_text_props(weight="bold")


def _updates(r: DecodeReplay) -> list[list[str]]:
    rows = []
    for split in r.splits:
        for step in split:
            last = step.index == len(split) - 1  # the split's partial result: lse_s = m_i + log(l_i)
            cells = [str(split.index), str(step.index + 1), span(*step.cols), step.tile_kind.name, _vec(step["m_i"])]
            rows.append([*cells, _vec(step["l_i"]), _vec(split.lse_s) if last else "", f"{step.max_diff:.3g}"])
    return rows


def _merge_rows(r: DecodeReplay) -> list[list[str]]:
    rows = []
    for m in r.merges:
        merged = m.label
        lses = [_vec(m["lse_a"]), _vec(m["lse_b"]), _vec(m["lse"])]
        rows.append([merged, *lses, _vec(m["w_a"]), _vec(m["w_b"]), f"{m.max_diff:.3g}"])
    return rows


def _errors(ax: Any, r: DecodeReplay) -> None:
    labels, values, colours = [], [], []
    for split in r.splits:
        for step in split:
            labels.append(f"s{split.index} t{step.index + 1}")
            values.append(step.max_diff)
            colours.append(SPLIT_COLOURS[split.index % len(SPLIT_COLOURS)])
    for m in r.merges:
        labels.append(f"merge {m.index + 1}")
        values.append(m.max_diff)
        colours.append("#444")
    x = range(len(values))
    ax.bar(x, [max(v, FLOOR) for v in values], color=colours, edgecolor="#333", lw=0.5)
    ax.set_yscale("log")
    ax.set_ylim(FLOOR, 30 * max(1.0, *values))
    ax.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    for xx, v in zip(x, values, strict=True):
        ax.text(xx, max(v, FLOOR) * 1.6, f"{v:.2g}", ha="center", fontsize=7)
    ax.set_title("max |O − O_final| after each event (log)", fontsize=9, loc="left")


def render_decode_png(r: DecodeReplay, path: str | Path, *, dpi: int = 130) -> Path:
    """Write ``r`` as a PNG to ``path``: the cache, the tile updates and merges, the error."""
    updates, merges = _updates(r), _merge_rows(r)
    if r.N_max > MAX_DRAWN_KEYS or len(updates) + len(merges) > MAX_DRAWN_ROWS:
        raise AttentionValueError(
            f"the PNG picture draws every cache slot (at most {MAX_DRAWN_KEYS}, here N_max={r.N_max}) and every "
            f"tile update and merge (at most {MAX_DRAWN_ROWS} rows, here {len(updates) + len(merges)}): use a "
            "smaller cache, a larger block_n, or the table or JSON output"
        )
    from matplotlib.figure import Figure

    grid_h, updates_h, merges_h = 0.9 + 0.4 * r.N_new, 0.3 + 0.24 * (len(updates) + 1), 0.4 + 0.24 * (len(merges) + 1)
    fig = Figure(figsize=(12, 1.2 + grid_h + updates_h + merges_h), layout="constrained")
    grid = fig.add_gridspec(3, 2, height_ratios=(grid_h, updates_h, merges_h), width_ratios=(2.2, 1))
    _cache(fig.add_subplot(grid[0, :]), r)
    rows = f"(q0{', …' * (r.N_new > 2)}{f', q{r.N_new - 1}' * (r.N_new > 1)})"
    header = ["split", "update", "keys", "tile", f"m_i {rows}", "l_i", "lse_s = m_i + log l_i", "max |O_s − O_final|"]
    _table(fig.add_subplot(grid[1, 0]), header, updates, "tile updates inside each split (online softmax)")
    _errors(fig.add_subplot(grid[1:, 1]), r)
    if merges:
        header = [
            "a + b",
            "lse_a",
            "lse_b",
            "lse",
            "w_a = exp(lse_a − lse)",
            "w_b = exp(lse_b − lse)",
            "max |O − O_final|",
        ]
        _table(
            fig.add_subplot(grid[2, 0]),
            header,
            merges,
            "merges: lse = log(exp(lse_a) + exp(lse_b)), O = w_a O_a + w_b O_b",
        )
    fig.suptitle(
        f"Decode step replay · {r.cache_len} cached + {r.N_new_kv} new keys, N_new={r.N_new} · "
        f"num_splits={r.num_splits}, BLOCK_N={r.block_n}"
        + ("" if r.page_size is None else f" · paged, page_size {r.page_size}, pages {list(r.pages)}")
        + "".join(f" · {label}" for label in r.labels()),
        fontsize=11,
    )
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    return path
