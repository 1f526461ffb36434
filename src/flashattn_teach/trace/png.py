"""A replay as a picture (matplotlib): one row per tile update, the schedule grid next to the vector bars.

Uses ``matplotlib.figure.Figure`` directly, not pyplot, so rendering never changes a notebook's backend.
"""

from __future__ import annotations

import math
from pathlib import Path

from .html import LEGEND_COLOURS
from .manifest import to_experiment
from .replay import Replay

VECTOR_COLOURS = ("#7f7f7f", "#d62728", "#9467bd", "#1f77b4", "#2ca02c")


def _cell_colour(replay: Replay, states: list[list[str]], r: int, c: int) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb

    state = states[r // replay.block_m][c // replay.block_n]
    rgb = to_rgb(LEGEND_COLOURS[state])
    if replay.causal and state != "skipped" and c > r + replay.diagonal_offset:  # masked cell of a partial tile
        return tuple(1 - 0.4 * (1 - ch) for ch in rgb)
    return rgb


def _grid(ax, replay: Replay, case_index: int, legend: bool) -> None:
    from matplotlib.patches import Patch

    states = replay.grid(replay.steps[case_index])
    image = [[_cell_colour(replay, states, r, c) for c in range(replay.N_k)] for r in range(replay.N_q)]
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
        handles = [Patch(facecolor=colour, edgecolor="#888", label=state) for state, colour in LEGEND_COLOURS.items()]
        ax.legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(0, -0.25), ncol=3, frameon=False)


def _bars(ax, case: dict, limit: float) -> None:
    labels, values, colours = [], [], []
    for vector, colour in zip(case["vectors"], VECTOR_COLOURS, strict=True):
        for k, x in enumerate(vector["values"]):
            labels.append(f"{vector['label']} [{k}]" if k == 0 else f"[{k}]")
            values.append(x)
            colours.append(colour)
    y = range(len(values))
    ax.barh(y, [0.0 if x is None else x for x in values], color=colours)
    for yy, x in zip(y, values, strict=True):
        text = "−∞" if x is None else f"{x:.4g}"
        ax.text(limit * 1.02, yy, text, va="center", fontsize=6, family="monospace")
    ax.set_yticks(list(y), labels, fontsize=6)
    ax.invert_yaxis()
    ax.axvline(0, color="#444", lw=0.8)
    ax.set_xlim(-limit, limit)
    ax.tick_params(axis="x", labelsize=6)
    error = case["metrics"][2]
    ax.set_title(f"{case['label']}  ·  {error['label']}: {error['value']:.3g}", fontsize=8, loc="left")


def render_png(replay: Replay, path: str | Path, *, step: int | None = None, dpi: int = 130) -> Path:
    """Write ``replay`` as a PNG to ``path``: every tile update, or only update ``step`` (1-based)."""
    from matplotlib.figure import Figure

    experiment = to_experiment(replay)
    indices = list(range(len(replay.steps))) if step is None else [step - 1]
    if not indices or not 0 <= indices[0] < len(replay.steps):
        raise ValueError(f"step must be in [1, {len(replay.steps)}], got {step}")
    # One scale for all bars of all updates, as on the HTML page.
    limit = max(
        (abs(x) for case in experiment["cases"] for v in case["vectors"] for x in v["values"] if x is not None),
        default=1.0,
    )
    limit = 1.0 if limit == 0 or not math.isfinite(limit) else limit * 1.05
    n_bars = (
        len(experiment["cases"][0]["vectors"][0]["values"])
        + 2 * (replay.rows[1] - replay.rows[0])
        + 2 * len(experiment["cases"][0]["vectors"][3]["values"])
    )
    row_height = max(2.6, 0.14 * n_bars + 0.6)
    fig = Figure(figsize=(10, row_height * len(indices) + 0.6), layout="constrained")
    axes = fig.subplots(len(indices), 2, squeeze=False, width_ratios=(1, 2.4))
    for row, ((ax_grid, ax_bars), k) in enumerate(zip(axes, indices, strict=True)):
        _grid(ax_grid, replay, k, legend=row == 0)
        ax_grid.set_title(f"update {k + 1} of {len(replay.steps)}", fontsize=8)
        _bars(ax_bars, experiment["cases"][k], limit)
    fig.suptitle(
        f"Tile replay · {replay.order} · query block {replay.query_block} · BLOCK_M={replay.block_m}, "
        f"BLOCK_N={replay.block_n}" + (f" · causal ({replay.causal_align})" if replay.causal else ""),
        fontsize=10,
    )
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    return path
