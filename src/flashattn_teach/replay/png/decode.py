"""A decode step as a picture (matplotlib): the ``N_new x N_max`` scores of the step coloured by split (pale
where masked, grey where the slot is unused), the key roles above and the tiles inside each split, a paged cache's
page boundaries and block ids; then each split's tile updates (``m_i``, ``l_i``, the error) and the merges
(``lse_a``, ``lse_b``, ``lse``, the weights); right, the error after every event on a log scale. With
``source="triton"``, under the tables, the kernel beside the reference at each tile update and merge: per traced
term its first value in both columns and the largest difference (:func:`.kernel_view_decode.decode_kernel_lines`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from ...errors import AttentionValueError
from ..decode_replay import DecodeReplay, KeyRole
from ..kernel_view_decode import decode_kernel_lines
from ..manifest import span
from .common import DPI, fmt, pale, save, text_block

SPLIT_COLOURS = ("#8dd3c7", "#fdb462", "#bebada", "#fb8072", "#80b1d3", "#b3de69", "#fccde5", "#bc80bd")
UNUSED_COLOUR = "#e0e0e0"
ROLE_COLOURS = {KeyRole.OLD: "#333333", KeyRole.NEW: "#c2185b", KeyRole.UNUSED: "#999999"}
PAGE_COLOUR = "#1565c0"  # a paged cache: page boundaries and each slot's block id
MAX_DRAWN_KEYS = 48  # one column per cache slot, with its label
MAX_DRAWN_ROWS = 40  # table rows: tile updates and merges
FLOOR = 1e-18  # an error of exactly 0 drawn on the log scale
KERNEL_COLUMNS = 2  # source="triton": the kernel's lines, its steps' blocks in this many columns
LINE_HEIGHT = 0.125  # inches per line of 6.5-point monospace


def _vec(t: Tensor) -> str:
    return ", ".join(fmt(float(x)) for x in t.tolist())


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
            row.append(to_rgb(colour) if visible[i][j] or s is None else pale(colour, 0.3))
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


def _kernel_columns(blocks: list[list[str]]) -> list[list[str]]:
    """The kernel's blocks of lines, one per step, in order in up to :data:`KERNEL_COLUMNS` columns of about equal
    length (a block stays whole: it starts the next column when its middle would pass the column's share)."""
    share = sum(len(b) + 1 for b in blocks) / KERNEL_COLUMNS
    columns: list[list[str]] = []
    for block in blocks:
        if not columns or (len(columns) < KERNEL_COLUMNS and len(columns[-1]) + len(block) / 2 > share):
            columns.append([])
        columns[-1] += [*block, ""]
    return columns


def _kernel(fig: Any, cell: Any, columns: list[list[str]]) -> None:
    """The kernel beside the reference under the tables: one text block per column."""
    axes = cell.subgridspec(1, KERNEL_COLUMNS).subplots()
    axes[0].set_title(
        "the kernel (triton/kernels/decode.py) beside the reference: each term's first value, reference then "
        "kernel, and max |difference| over the term",
        fontsize=9,
        loc="left",
    )
    for n, ax in enumerate(axes):
        text_block(ax, columns[n] if n < len(columns) else [], 6.5)


def render_decode_png(r: DecodeReplay, path: str | Path, *, dpi: int = DPI) -> Path:
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
    columns = _kernel_columns(decode_kernel_lines(r))  # [] for the reference alone
    kernel_h = 0.6 + LINE_HEIGHT * max((len(c) for c in columns), default=0)
    heights = (grid_h, updates_h, merges_h, *([kernel_h] if columns else []))
    fig = Figure(figsize=(12, 1.2 + sum(heights)), layout="constrained")
    grid = fig.add_gridspec(len(heights), 2, height_ratios=heights, width_ratios=(2.2, 1))
    _cache(fig.add_subplot(grid[0, :]), r)
    rows = f"(q0{', …' * (r.N_new > 2)}{f', q{r.N_new - 1}' * (r.N_new > 1)})"
    header = ["split", "update", "keys", "tile", f"m_i {rows}", "l_i", "lse_s = m_i + log l_i", "max |O_s − O_final|"]
    _table(fig.add_subplot(grid[1, 0]), header, updates, "tile updates inside each split (online softmax)")
    _errors(fig.add_subplot(grid[1:3, 1]), r)
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
    if columns:
        _kernel(fig, grid[3, :], columns)
    fig.suptitle(
        f"Decode step replay · {r.cache_len} cached + {r.N_new_kv} new keys, N_new={r.N_new} · "
        f"num_splits={r.num_splits}, BLOCK_N={r.block_n}"
        + ("" if r.page_size is None else f" · paged, page_size {r.page_size}, pages {list(r.pages)}")
        + "".join(f" · {label}" for label in r.labels()),
        fontsize=11,
    )
    return save(fig, path, dpi)
