"""A backward replay as pictures (matplotlib), one per tile step of FA2 Alg. 2's two passes, each legible at
screen size (:data:`FIGURE_WIDTH` inches: about 1560 pixels wide at the default dpi, under 1600 on the long side
for the default replay).

Each step's picture draws, for tile ``(i, j)`` of the dK/dV pass (key blocks outer) or the dQ pass (query
blocks outer): the ``(T_r, T_c)`` tile grid at this step (the current tile, the tiles that already went into
this step's accumulator, the other tiles done in this pass, the SKIP tiles), the tile's
``P_ij = exp(S_ij - lse_i)`` (Alg. 2 line 11), ``dP_ij = dO_i V_j^T`` (line 13) and
``dS_ij = P_ij * (dP_ij - delta_i)`` (line 14) with their numbers, the accumulators after the step
(``dV_j, dK_j``, lines 12 and 16, or ``dQ_i``, line 15), and the step's equations with their numbers
(:class:`~.step.StepEquation`). One more picture holds the preprocess (``O, dO, lse`` and
``delta = rowsum(dO * O)``, line 4) and the result: each gradient's error against float64 autograd.

Steps are numbered 1 to ``total`` as ``--step`` counts them: the dK/dV pass's steps first, then the dQ pass's.
All steps at once: ``path`` holds the preprocess and the result, ``<stem>_stepNN.png`` each step
(:func:`step_paths`).

"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from ...errors import AttentionValueError
from ..backward_replay import BackwardReplay
from ..html import LEGEND_COLOURS
from ..kernel_view_backward import kernel_lines
from ..step import Step, StepEquation, StepKind, TileState
from .common import DPI, legend_handles, save, text_block

__all__ = ["MAX_PNG_STEPS", "render_backward_png", "step_paths", "steps_of"]

MAX_PNG_STEPS = 48  # pictures of one call (both passes); a larger backward: one step at a time, or table/JSON
EQUATION_WIDTH = 110  # characters per line of the equations' text: 110 x 0.6 x 9 pt = 8.3 inches
FIGURE_WIDTH = 12  # inches: 1560 pixels at DPI
TEXT_POINTS, TITLE_POINTS = 9, 10  # the equations' and the titles' type size, legible at 100% zoom
LINE_INCHES = 1.25 * TEXT_POINTS / 72  # one line of the equations' text


def steps_of(br: BackwardReplay) -> list[Step]:
    """Every tile step of both passes, in the order they run: the dK/dV pass, then the dQ pass (the PREPROCESS
    has its own picture)."""
    return [s for s in br.all_steps() if s.step_kind is not StepKind.PREPROCESS]


def tile_states(br: BackwardReplay, steps: list[Step], n: int) -> list[list[TileState]]:
    """``(T_r, T_c)``: each tile's state at ``steps[n]``, within its pass. ACCUMULATED: an earlier tile of the
    same key block (dK/dV pass) or query block (dQ pass), whose terms are in the step's accumulators."""
    step = steps[n]
    T_r, T_c = len(br.tiling.row_blocks), len(br.tiling.col_blocks)
    states = [[TileState.PENDING] * T_c for _ in range(T_r)]
    for i, j in br.skipped():
        states[i][j] = TileState.SKIPPED
    outer = (lambda s: s.j) if step.step_kind is StepKind.DKDV else (lambda s: s.i)
    for s in steps[:n]:
        if s.step_kind is step.step_kind:
            states[s.i][s.j] = TileState.ACCUMULATED if outer(s) == outer(step) else TileState.DONE
    states[step.i][step.j] = TileState.CURRENT
    return states


def _grid(ax: Any, states: list[list[TileState]], legend: bool) -> None:
    from matplotlib.colors import to_rgb

    ax.imshow([[to_rgb(LEGEND_COLOURS[s]) for s in row] for row in states], interpolation="nearest")
    for r in range(len(states) + 1):
        ax.axhline(r - 0.5, color="#222", lw=1)
    for c in range(len(states[0]) + 1):
        ax.axvline(c - 0.5, color="#222", lw=1)
    ax.set_xticks(range(len(states[0])))
    ax.set_yticks(range(len(states)))
    ax.tick_params(labelsize=TEXT_POINTS - 1, length=0)
    ax.set_xlabel("key block j", fontsize=TEXT_POINTS - 1)
    ax.set_ylabel("query block i", fontsize=TEXT_POINTS - 1)
    if legend:  # to the right of the grid, one state a line
        ax.legend(
            handles=legend_handles(),
            fontsize=TEXT_POINTS - 1,
            loc="upper left",
            bbox_to_anchor=(1.02, 1),
            frameon=False,
        )


def cell_text(x: float) -> str:
    """A matrix cell as drawn: 3 significant digits, ``-inf`` as ``−∞``."""
    return "−∞" if x == -math.inf else f"{x:.3g}"


def _cell_points(ax: Any, n_rows: int, n_cols: int) -> float:
    """The type size of a cell's value: 7 characters fit a cell of ``ax`` (placed in inches, :func:`_axes`),
    between 5 and :data:`TEXT_POINTS` points."""
    box, (W, H) = ax.get_position(), ax.get_figure().get_size_inches()
    fits = min(72 * box.width * W / n_cols / (7 * 0.62), 72 * box.height * H / n_rows / 1.5)
    return max(5.0, min(float(TEXT_POINTS), fits))


def _matrix(ax: Any, title: str, M: Tensor, rows: tuple[int, int], row_label: str, col_label: str) -> None:
    """``M (r, c)`` as a heat map with every value written in its cell; rows numbered from ``rows[0]``."""
    values = M.tolist()
    points = _cell_points(ax, len(values), len(values[0]))
    finite = [abs(x) for row in values for x in row if math.isfinite(x)]
    limit = max(finite, default=1.0) or 1.0
    shown = [[x if math.isfinite(x) else 0.0 for x in row] for row in values]
    # Twice the largest magnitude at the ends of the colour map: pale cells, so the written values stay legible.
    ax.imshow(shown, cmap="RdBu_r", vmin=-2 * limit, vmax=2 * limit, interpolation="nearest", aspect="auto")
    for r, row in enumerate(values):
        for c, x in enumerate(row):
            ax.text(c, r, cell_text(x), ha="center", va="center", fontsize=points, family="monospace")
    ax.set_xticks(range(len(values[0])))
    ax.set_yticks(range(len(values)), [str(rows[0] + r) for r in range(len(values))])
    ax.tick_params(labelsize=TEXT_POINTS - 1, length=0)
    ax.set_xlabel(col_label, fontsize=TEXT_POINTS - 1)
    ax.set_ylabel(row_label, fontsize=TEXT_POINTS - 1)
    ax.set_title(title, fontsize=TITLE_POINTS)


def equation_lines(step: Step, width: int = EQUATION_WIDTH) -> list[str]:
    """The step's equations as text lines of at most about ``width`` characters: ``line  name = symbolic``,
    then the numbers put in and the result."""
    return equation_lines_of(step.equations, width)


def equation_lines_of(equations: Sequence[StepEquation], width: int = EQUATION_WIDTH) -> list[str]:
    """:func:`equation_lines` of any list of equations (the preprocess's too)."""
    out: list[str] = []
    for eq in equations:
        line = "   " if eq.line is None else f"{eq.line:>3}"
        out.append(f"line {line}  {eq.name} = {eq.symbolic}")
        out += textwrap.wrap(eq.substituted, width, initial_indent=" " * 10, subsequent_indent=" " * 12)
    return out


def step_paths(path: Path, total: int) -> list[Path]:
    """The files of steps ``1..total`` next to ``path``: ``<stem>_stepNN<suffix>``, ``NN`` zero-padded to
    the digits of ``total`` (at least 2), so the files sort in step order."""
    digits = max(2, len(str(total)))
    return [path.with_name(f"{path.stem}_step{n:0{digits}d}{path.suffix}") for n in range(1, total + 1)]


def _heading(br: BackwardReplay) -> str:
    extras = [f"softcap {br.softcap:g}"] if br.softcap is not None else []
    extras += [f"sink {float(br.sink[0]):g}"] if br.sink is not None else []
    return (
        f"Backward replay (FlashAttention-2 Alg. 2) · N_q={br.q.shape[0]}, N_k={br.k.shape[0]} · "
        f"BLOCK_M={br.block_m}, BLOCK_N={br.block_n} · scale {br.scale:.4g}" + "".join(f" · {x}" for x in extras)
    )


def _axes(fig: Any, left: float, top: float, width: float, height: float) -> Any:
    """An axis placed in inches from the figure's top left corner (a fixed layout: no layout engine's
    passes, which cost as much as the drawing)."""
    W, H = fig.get_size_inches()
    return fig.add_axes((left / W, 1 - (top + height) / H, width / W, height / H))


def _step_figure(br: BackwardReplay, steps: list[Step], n: int) -> Any:
    """Step ``steps[n]``: the grid, ``P_ij, dP_ij, dS_ij``, then the accumulators, then the equations."""
    from matplotlib.figure import Figure

    s = steps[n]
    lines = equation_lines(s) + kernel_lines(br, s)  # source="triton": the kernels' numbers too
    row0, row1, text = 0.95, 0.95 + 2.2 + 0.8, 0.95 + 2.2 + 0.8 + 1.6 + 0.7  # tops, inches
    fig = Figure(figsize=(FIGURE_WIDTH, text + LINE_INCHES * len(lines) + 0.2))
    _grid(_axes(fig, 0.7, row0, 1.9, 2.2), tile_states(br, steps, n), legend=True)
    fig.axes[0].set_title(f"tile (i={s.i}, j={s.j}) · {s.tile_kind.name}", fontsize=TITLE_POINTS)
    cols = f"key column from {s.cols[0]}"
    for left, (name, M) in zip(
        (4.1, 6.75, 9.4), (("P_ij", s["P_ij"]), ("dP_ij", s["dP_ij"]), ("dS_ij", s["dS_ij"])), strict=True
    ):
        _matrix(_axes(fig, left, row0, 2.2, 2.2), name, M, s.rows, "query row", cols)
    rows = s.cols if s.step_kind is StepKind.DKDV else s.rows
    label = "key row" if s.step_kind is StepKind.DKDV else "query row"
    for left, (name, acc) in zip((0.7, 6.5), s.accumulators.items(), strict=False):
        _matrix(_axes(fig, left, row1, 5.1, 1.6), f"{name} after this step", acc, rows, label, "feature")
    text_block(_axes(fig, 0.3, text, FIGURE_WIDTH - 0.6, LINE_INCHES * len(lines)), lines, TEXT_POINTS)
    (r0, r1), (c0, c1) = s.rows, s.cols
    fig.suptitle(
        f"step {n + 1} of {len(steps)} · {s.step_kind.title} · tile (i={s.i}, j={s.j}) · query rows "
        f"{r0}–{r1 - 1} · key columns {c0}–{c1 - 1}\n{_heading(br)}",
        fontsize=TITLE_POINTS + 1,
        y=1 - 0.12 / fig.get_figheight(),
        va="top",
    )
    return fig


def _result_figure(br: BackwardReplay, files: list[Path]) -> Any:
    """The preprocess (``O, dO, lse, delta``), the gradients' errors, and which file holds which step."""
    from matplotlib.figure import Figure

    N_q, D = br.O.shape
    errors = [f"  max |{name} - oracle| = {error:.3e}" for name, error in br.max_error().items()]
    preprocess = [f"  {line}" for line in equation_lines_of(br.preprocess().equations)]
    height = min(9.0, max(2.4, 0.32 * N_q))  # the matrices': a row of cells about a line of text tall
    text = 0.9 + height + 0.75  # top of the text, inches
    fig = Figure(figsize=(FIGURE_WIDTH, text + LINE_INCHES * (len(preprocess) + len(errors) + 6) + 0.3))
    matrix_width = (FIGURE_WIDTH - 0.7 - 3 * 0.6 - 0.2) / (2 * D + 3)  # inches per column; lse, delta 1.5 each
    left = 0.7
    for name, M in (("O", br.O), ("dO", br.dO), ("lse", br.lse[:, None]), ("delta", br.delta[:, None])):
        width = matrix_width * (D if M.shape[1] > 1 else 1.5)
        _matrix(_axes(fig, left, 0.9, width, height), name, M, (0, N_q), "query row", "feature" * (M.shape[1] > 1))
        left += width + 0.6
    dkdv = sum(1 for _ in br.dkdv_steps())
    lines = [
        "Preprocess (line 4), before either pass:",
        *preprocess,
        "",
        "Result, against float64 torch.autograd of dense attention:",
        *errors,
        "",
        f"The steps: dK/dV pass {files[0].name} to {files[dkdv - 1].name}" if dkdv else "The steps:",
        f"           dQ pass {files[dkdv].name} to {files[-1].name}" if dkdv < len(files) else "",
    ]
    text_block(_axes(fig, 0.3, text, FIGURE_WIDTH - 0.6, LINE_INCHES * len(lines)), lines, TEXT_POINTS)
    fig.suptitle(
        f"{_heading(br)}\nthe preprocess and the result",
        fontsize=TITLE_POINTS + 1,
        y=1 - 0.12 / fig.get_figheight(),
        va="top",
    )
    return fig


def render_backward_png(br: BackwardReplay, path: str | Path, *, step: int | None = None, dpi: int = DPI) -> list[Path]:
    """Write ``br`` as PNGs legible at screen size: with ``step`` (1-based, counting the dK/dV pass's steps
    first, then the dQ pass's) that step alone to ``path``; without, every step of both passes (at most
    :data:`MAX_PNG_STEPS`) to ``<stem>_stepNN.png`` (:func:`step_paths`) and the preprocess and the result to
    ``path``. Returns the files written, ``path`` first."""
    steps = steps_of(br)
    total = len(steps)
    if total == 0:
        raise AttentionValueError("every tile is skipped, so the backward has no step to draw")
    if step is not None and not 1 <= step <= total:
        raise AttentionValueError(f"step must be in [1, {total}], got {step}")
    if step is None and total > MAX_PNG_STEPS:
        raise AttentionValueError(
            f"the backward has {total} steps, more than the {MAX_PNG_STEPS} pictures one call draws: pass step= "
            "for one of them, or use the table or JSON output"
        )
    path = Path(path)
    if step is not None:
        return [save(_step_figure(br, steps, step - 1), path, dpi)]
    files = [save(_step_figure(br, steps, n), file, dpi) for n, file in enumerate(step_paths(path, total))]
    return [save(_result_figure(br, files), path, dpi), *files]
