"""A forward replay as a picture (matplotlib): one row per tile update, the schedule grid next to the vector bars.

Next to each drawn update, its equations with their numbers (FA2 Alg. 1; a key-major replay's FA1 Alg. 1,
:func:`..equations_view.replay_equations`): the block's first row in full, one compact line per other row.

With an attention sink, each update's title gives every row's sink share so far, ``exp(sink_h - m_i) / l_i``
(at the last update the final ``exp(sink_h - lse_i)``), and the heading names the sink.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from torch import Tensor

from ...errors import AttentionValueError
from ..equations_view import replay_equations
from ..html import LEGEND_COLOURS, check_drawable
from ..kernel_view import kernel_lines
from ..replay import Replay
from ..step import Step, TileState
from .common import DPI, RGB, fmt, legend_handles, pale, save, text_block

VECTOR_COLOURS = ("#7f7f7f", "#d62728", "#9467bd", "#1f77b4", "#2ca02c")


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
    if state is not TileState.SKIPPED and not visible[r][c]:  # a masked cell of a visited tile: pale
        return pale(LEGEND_COLOURS[state], 0.4)
    return to_rgb(LEGEND_COLOURS[state])


def _grid(ax: Any, replay: Replay, step: Step, visible: list[list[bool]], legend: bool) -> None:
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
        ax.legend(
            handles=legend_handles(), fontsize=6, loc="upper left", bbox_to_anchor=(0, -0.25), ncol=3, frameon=False
        )


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
        ax.text(limit * 1.02, yy, fmt(x), va="center", fontsize=6, family="monospace")
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


def render_forward_png(replay: Replay, path: str | Path, *, step: int | None = None, dpi: int = DPI) -> Path:
    """Write ``replay`` as a PNG to ``path``: every tile update, or only update ``step`` (1-based)."""
    from matplotlib.figure import Figure

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
        text_block(ax_equations, equations[s.index], 6)
    fig.suptitle(
        f"Tile replay · {replay.order} · query block {replay.query_block} · BLOCK_M={replay.block_m}, "
        f"BLOCK_N={replay.block_n}" + "".join(f" · {label}" for label in replay.labels()),
        fontsize=10,
    )
    return save(fig, path, dpi)
