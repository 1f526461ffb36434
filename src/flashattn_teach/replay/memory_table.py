"""The memory of one tile update in the terminal (rich): the on-chip buffers and the HBM bytes so far.

:func:`memory_panel` draws one :class:`~.memory.MemoryStep` of a :class:`~.memory.MemoryFigure` (see
:mod:`.memory` for the counting rules); ``render_table`` adds it under each update's statistics.
"""

from __future__ import annotations

from typing import Any

from .memory import MemoryFigure

BAR_WIDTH = 12  # characters for the dense path's total bytes


def _bar(value: int, scale: int) -> str:
    filled = min(BAR_WIDTH, round(BAR_WIDTH * value / scale)) if scale else 0
    return "█" * filled + "·" * (BAR_WIDTH - filled)


def memory_panel(figure: MemoryFigure, index: int) -> Any:
    """Step ``index``: what is on chip, and per tensor the HBM bytes read and written so far beside what
    standard attention (Alg. 0) moves in total; bars share one scale, the dense path's total."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    step = figure.steps[index]
    chip = Table(title="On chip", title_justify="left", box=None, pad_edge=False)
    for column in ("buffer", "shape", "bytes"):
        chip.add_column(column, justify="right" if column == "bytes" else "left")
    for buffer in step.on_chip:
        chip.add_row(buffer.name, " x ".join(map(str, buffer.shape)), str(buffer.bytes))
    chip.add_row("total", "", str(step.on_chip_bytes), style="bold")

    scale = figure.dense.total_bytes
    hbm = Table(
        title=f"HBM bytes so far (bars: of the dense path's {scale} B)",
        title_justify="left",
        box=None,
        pad_edge=False,
    )
    for column in ("tensor", "read so far", "written so far", "dense read", "dense written"):
        hbm.add_column(column, justify="left" if column == "tensor" else "right")
    tensors = dict.fromkeys([*figure.total.reads, *figure.total.writes, *figure.dense.reads, *figure.dense.writes])
    rows = [
        (
            t,
            step.hbm.reads.get(t, 0),
            step.hbm.writes.get(t, 0),
            figure.dense.reads.get(t, 0),
            figure.dense.writes.get(t, 0),
        )
        for t in tensors
    ]
    rows.append(("all", step.hbm.read_bytes, step.hbm.write_bytes, figure.dense.read_bytes, figure.dense.write_bytes))
    for name, *values in rows:
        hbm.add_row(name, *(f"{_bar(x, scale)} {x}" for x in values), style="bold" if name == "all" else None)
    closed = (
        "iomodel has no closed form for this mask or shape"
        if figure.closed_form is None
        else f"iomodel's closed form: {figure.closed_form.total_bytes} B"
    )
    head = Text(
        f"Memory · schedule position {step.position + 1} of {figure.schedule_length} · matrices "
        f"{figure.elem_bytes} B per element · whole schedule {figure.total.total_bytes} B ({closed})",
        style="dim",
    )
    side_by_side = Table.grid(padding=(0, 3))
    side_by_side.add_row(chip, hbm)
    return Group(head, side_by_side)
