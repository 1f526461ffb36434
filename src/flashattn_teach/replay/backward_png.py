"""A backward replay as a picture (matplotlib): one row per tile step of FA2 Alg. 2's two passes.

Each row draws, for tile ``(i, j)`` of the dK/dV pass (key blocks outer) or the dQ pass (query blocks outer):
the ``(T_r, T_c)`` tile grid at this step (the current tile, the tiles that already went into this step's
accumulator, the other tiles done in this pass, the SKIP tiles), the tile's ``P_ij = exp(S_ij - lse_i)``
(Alg. 2 line 11), ``dP_ij = dO_i V_j^T`` (line 13) and ``dS_ij = P_ij * (dP_ij - delta_i)`` (line 14) with
their numbers, the accumulators after the step (``dV_j, dK_j``, lines 12 and 16, or ``dQ_i``, line 15), and
the step's equations with their numbers (:class:`~.backward_replay.BackwardEquation`). The heading gives the
preprocess (``delta = rowsum(dO * O)``, line 4) and the worst gradient error against float64 autograd.

Uses ``matplotlib.figure.Figure`` directly, not pyplot, as :mod:`.png` does.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

from torch import Tensor

from ..errors import AttentionValueError
from .backward_replay import BackwardPass, BackwardReplay, BackwardStep, numbers
from .html import LEGEND_COLOURS
from .steps import TileState

__all__ = ["MAX_PNG_STEPS", "render_backward_png"]

MAX_PNG_STEPS = 48  # rows of one picture (both passes); a larger backward: one step at a time, or table/JSON
PASS_TITLES = {BackwardPass.DKDV: "dK/dV pass", BackwardPass.DQ: "dQ pass"}
EQUATION_WIDTH = 110  # characters per line of the equations' text


def _steps(br: BackwardReplay) -> list[BackwardStep]:
    """Every step of both passes, in the order they run: the dK/dV pass, then the dQ pass."""
    return [*br.dkdv_steps(), *br.dq_steps()]


def tile_states(br: BackwardReplay, steps: list[BackwardStep], n: int) -> list[list[TileState]]:
    """``(T_r, T_c)``: each tile's state at ``steps[n]``, within its pass. ACCUMULATED: an earlier tile of the
    same key block (dK/dV pass) or query block (dQ pass), whose terms are in the step's accumulators."""
    step = steps[n]
    T_r, T_c = len(br.tiling.row_blocks), len(br.tiling.col_blocks)
    states = [[TileState.PENDING] * T_c for _ in range(T_r)]
    for i, j in br.skipped():
        states[i][j] = TileState.SKIPPED
    outer = (lambda s: s.j) if step.pass_name is BackwardPass.DKDV else (lambda s: s.i)
    for s in steps[:n]:
        if s.pass_name is step.pass_name:
            states[s.i][s.j] = TileState.ACCUMULATED if outer(s) == outer(step) else TileState.DONE
    states[step.i][step.j] = TileState.CURRENT
    return states


def _grid(ax: Any, states: list[list[TileState]], legend: bool) -> None:
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch

    ax.imshow([[to_rgb(LEGEND_COLOURS[s]) for s in row] for row in states], interpolation="nearest")
    for r in range(len(states) + 1):
        ax.axhline(r - 0.5, color="#222", lw=1)
    for c in range(len(states[0]) + 1):
        ax.axvline(c - 0.5, color="#222", lw=1)
    ax.set_xticks(range(len(states[0])))
    ax.set_yticks(range(len(states)))
    ax.tick_params(labelsize=7, length=0)
    ax.set_xlabel("key block j", fontsize=7)
    ax.set_ylabel("query block i", fontsize=7)
    if legend:
        handles = [Patch(facecolor=colour, edgecolor="#888", label=s.value) for s, colour in LEGEND_COLOURS.items()]
        ax.legend(handles=handles, fontsize=5, loc="upper left", bbox_to_anchor=(0, -0.3), ncol=2, frameon=False)


def cell_text(x: float) -> str:
    """A matrix cell as drawn: 3 significant digits, ``-inf`` as ``−∞``."""
    return "−∞" if x == -math.inf else f"{x:.3g}"


def _matrix(ax: Any, title: str, M: Tensor, rows: tuple[int, int], row_label: str, col_label: str) -> None:
    """``M (r, c)`` as a heat map with every value written in its cell; rows numbered from ``rows[0]``."""
    values = M.tolist()
    finite = [abs(x) for row in values for x in row if math.isfinite(x)]
    limit = max(finite, default=1.0) or 1.0
    shown = [[x if math.isfinite(x) else 0.0 for x in row] for row in values]
    # Twice the largest magnitude at the ends of the colour map: pale cells, so the written values stay legible.
    ax.imshow(shown, cmap="RdBu_r", vmin=-2 * limit, vmax=2 * limit, interpolation="nearest", aspect="auto")
    for r, row in enumerate(values):
        for c, x in enumerate(row):
            ax.text(c, r, cell_text(x), ha="center", va="center", fontsize=5.5, family="monospace")
    ax.set_xticks(range(len(values[0])))
    ax.set_yticks(range(len(values)), [str(rows[0] + r) for r in range(len(values))])
    ax.tick_params(labelsize=6, length=0)
    ax.set_xlabel(col_label, fontsize=6)
    ax.set_ylabel(row_label, fontsize=6)
    ax.set_title(title, fontsize=7)


def equation_lines(step: BackwardStep, width: int = EQUATION_WIDTH) -> list[str]:
    """The step's equations as text lines of at most about ``width`` characters: ``line  name = symbolic``,
    then the numbers put in and the result."""
    out: list[str] = []
    for eq in step.equations:
        line = "   " if eq.line is None else f"{eq.line:>3}"
        out.append(f"line {line}  {eq.name} = {eq.symbolic}")
        out += textwrap.wrap(eq.substituted, width, initial_indent=" " * 10, subsequent_indent=" " * 12)
    return out


def _accumulators(axes: list[Any], step: BackwardStep) -> None:
    """``dV_j, dK_j (Bc, D)`` or ``dQ_i (Br, D)`` after the step; an unused axis is hidden."""
    rows = step.cols if step.pass_name is BackwardPass.DKDV else step.rows
    label = "key row" if step.pass_name is BackwardPass.DKDV else "query row"
    for ax, (name, acc) in zip(axes, step.acc.items(), strict=False):
        _matrix(ax, f"{name} after this step", acc, rows, label, "feature")
    for ax in axes[len(step.acc) :]:
        ax.axis("off")


def render_backward_png(br: BackwardReplay, path: str | Path, *, step: int | None = None, dpi: int = 130) -> Path:
    """Write ``br`` as a PNG to ``path``: every step of both passes (at most :data:`MAX_PNG_STEPS`), or only
    step ``step`` (1-based, counting the dK/dV pass's steps first, then the dQ pass's)."""
    from matplotlib.figure import Figure

    steps = _steps(br)
    total = len(steps)
    if total == 0:
        raise AttentionValueError("every tile is skipped, so the backward has no step to draw")
    if step is not None and not 1 <= step <= total:
        raise AttentionValueError(f"step must be in [1, {total}], got {step}")
    if step is None and total > MAX_PNG_STEPS:
        raise AttentionValueError(
            f"the backward has {total} steps, more than the {MAX_PNG_STEPS} one picture draws: pass step= for one "
            "of them, or use the table or JSON output"
        )
    drawn = range(total) if step is None else [step - 1]
    n_lines = max(len(equation_lines(steps[n])) for n in drawn)
    row_height = max(2.2, 0.1 * n_lines + 0.5)
    fig = Figure(figsize=(22, row_height * len(drawn) + 0.8), layout="constrained")
    axes = fig.subplots(len(drawn), 7, squeeze=False, width_ratios=(1, 1, 1, 1, 1.2, 1.2, 5))
    for row, (ax, n) in enumerate(zip(axes, drawn, strict=True)):
        s = steps[n]
        _grid(ax[0], tile_states(br, steps, n), legend=row == 0)
        ax[0].set_title(
            f"{PASS_TITLES[s.pass_name]} · step {s.index + 1}\ntile (i={s.i}, j={s.j}) · {s.kind.name}", fontsize=7
        )
        for a, (name, M) in zip(ax[1:4], (("P_ij", s.P_ij), ("dP_ij", s.dP_ij), ("dS_ij", s.dS_ij)), strict=True):
            _matrix(a, name, M, s.rows, "query row", f"key column from {s.cols[0]}")
        _accumulators(list(ax[4:6]), s)
        ax[6].axis("off")
        ax[6].text(
            0,
            1,
            "\n".join(equation_lines(s)),
            va="top",
            ha="left",
            fontsize=5.5,
            family="monospace",
            transform=ax[6].transAxes,
        )
    worst = max(br.max_error().values())
    fig.suptitle(
        f"Backward replay (FlashAttention-2 Alg. 2) · N_q={br.q.shape[0]}, N_k={br.k.shape[0]} · "
        f"BLOCK_M={br.block_m}, BLOCK_N={br.block_n} · scale {br.scale:.4g} · preprocess delta = rowsum(dO * O) = "
        f"{numbers(br.delta)} · max |grad - float64 autograd| = {worst:.3e}",
        fontsize=9,
    )
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    return path
