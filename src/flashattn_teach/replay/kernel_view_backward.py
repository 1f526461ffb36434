"""The backward kernels' numbers beside the reference's (``replay_backward(..., source="triton")``,
:mod:`.kernel_trace_backward`), as the backward's renderers show them: the JSON's per-step ``"kernel"``
(:func:`kernel_case`) and the document's ``"kernel"`` (:func:`kernel_head`), the table's panel under each dK/dV and
dQ step (:func:`kernel_table`, each term by the first values of its first row) and the PNG's lines under each
step's equations (:func:`kernel_lines`).

Per step and per traced term (dK/dV: ``P_ij, dP_ij, dS_ij, dV_j, dK_j``; dQ: ``P_ij, dP_ij, dS_ij, dQ_i``), two
columns and their difference: the reference's term, the kernel's record of it (in the reference's units), and
``max |kernel - reference|`` over the tile. With the one-kernel backward a dQ step also says at which place its
partial reached dQ by the atomic adds (``order``), and the document lists every partial's (``dqOrder``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .backward_replay import BackwardReplay
from .kernel_trace_backward import KERNEL_SOURCE, NOTE
from .kernel_view import kernel_case as step_kernel_case
from .step import Step, StepKind

__all__ = ["kernel_case", "kernel_head", "kernel_lines", "kernel_table"]


SHOWN = 4  # the table's values of each term: its first row's first four (the difference is over the whole tile)


def kernel_case(br: BackwardReplay, step: Step) -> dict[str, Any]:
    """A step's ``"kernel"`` (:func:`.kernel_view.kernel_case`); a dQ step of the one-kernel backward also its
    partial's ``order``."""
    case = step_kernel_case(step)
    order = None if br.kernel is None or step.step_kind is not StepKind.DQ else br.kernel.order(step.i, step.j)
    if order is not None:
        case["order"] = order
    return case


def kernel_head(br: BackwardReplay) -> dict[str, Any]:
    """The document's ``"kernel"``: what ran, its tiles, whether dQ came by atomics and in which order, the note."""
    assert br.kernel is not None
    return {
        "source": KERNEL_SOURCE,
        "blockM": br.block_m,
        "blockN": br.block_n,
        "oneKernel": br.kernel.fused,
        "dqOrder": [list(t) for t in br.kernel.arrivals()],  # (i, j, order) in arrival order
        "dqOrderMoves": br.kernel.order_moves_dq(),  # max |dQ - dQ summed in the reverse order|; None: no atomics
        "tiles": br.note,
        "note": NOTE,
    }


def _digits(t: Tensor) -> str:
    return f"{float(t):.8g}"


def kernel_table(br: BackwardReplay, step: Step):
    """The table's panel: per term (tiles by their first row) the reference, the kernel and the difference."""
    from rich.table import Table

    order = None if br.kernel is None or step.step_kind is not StepKind.DQ else br.kernel.order(step.i, step.j)
    title = "Kernels (triton/kernels/backward_*.py) beside the reference"
    if order is not None:
        title += f" · this dQ partial reached dQ at place {order} of the atomic adds"
    table = Table(box=None, pad_edge=False, title=title, title_justify="left")
    for column in ("term", "reference", "kernel", "max |difference|"):
        table.add_column(column, justify="left" if column == "term" else "right")
    for name, mine in step.kernel.items():
        ref = step[name]
        cells = [" ".join(_digits(x) for x in values[0, :SHOWN]) for values in (ref, mine)]  # the first row's first
        first = step.cols[0] if name in ("dV_j", "dK_j") else step.rows[0]  # a key row, or a query row
        more = ", ..." if ref.shape[1] > SHOWN else ""
        table.add_row(f"{name} (row {first}{more})", *cells, f"{step.kernel_diff[name]:.3g}")
    return table


def kernel_lines(br: BackwardReplay, step: Step) -> list[str]:
    """The PNG's lines under a step's equations: per term its first value in both columns and the largest
    difference over the tile (and a dQ partial's place among the atomic adds); none for a step of the reference."""
    if not step.kernel:
        return []
    order = None if br.kernel is None or step.step_kind is not StepKind.DQ else br.kernel.order(step.i, step.j)
    where = "" if order is None else f" (this dQ partial reached dQ at place {order} of the atomic adds)"
    lines = ["", f"the kernels beside the reference, first value of each term{where}:"]
    for name, mine in step.kernel.items():
        ref, diff = step[name].reshape(-1)[0], step.kernel_diff[name]
        lines.append(
            f"  {name:6s} {_digits(ref):>16s} {_digits(mine.reshape(-1)[0]):>16s}   max |difference| {diff:.3g}"
        )
    return lines
