"""The kernel's numbers beside the reference's (``source="triton"``, :mod:`.kernel_trace`), as every renderer shows
them: the JSON's per-case ``"kernel"`` and top-level ``"kernel"`` (:func:`kernel_case`, :func:`kernel_head`), the
page's panel "Kernel beside reference" (:func:`build_view`, drawn by ``page_kernel.js`` from the case's
``"kernel"``), the table's panel under each update (:func:`kernel_table`) and the PNG's lines under each
update's equations (:func:`kernel_lines`).

Per update and per traced term (``S_ij, m_i, l_i, alpha, acc_new``), two columns and their difference:

    reference   the replay's own term (float64 from float64 inputs, else float32)
    kernel      the kernel's record of the same tile, in base e (m_i and S_ij: base 2 times ln 2)
    difference  max |kernel - reference| over the tile (equal infinities count 0)

The vectors (``m_i, l_i, alpha``, one number per query row) are written whole; the tiles (``S_ij`` ``(Br, Bc)``,
``acc_new`` ``(Br, D)``) too in the JSON, and by their first row in the table. Eight significant digits, since
what differs is in the last ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from .kernel_trace import KERNEL_TERMS, NOTE, PRODUCTION_NOTE
from .replay import Replay
from .step import Step

__all__ = [
    "KERNEL_SOURCE",
    "build_view",
    "kernel_case",
    "kernel_head",
    "kernel_lines",
    "kernel_table",
    "kernel_text",
    "tensor_json",
]

KERNEL_SOURCE = "core/kernel.py (the tutorial kernel), its trace build: TRACE=True"
PRODUCTION_SOURCE = "triton/kernels/forward.py (the production kernel), its trace build: TRACE=True, by pointers"
SOURCES = {"core": (KERNEL_SOURCE, NOTE), "production": (PRODUCTION_SOURCE, PRODUCTION_NOTE)}  # Replay.kernel's
VECTORS = ("m_i", "l_i", "alpha")  # (Br,): one number per query row


def tensor_json(t: Tensor) -> Any:
    """Nested lists, ``-inf`` (a masked score, an empty row's maximum or lse) as None."""
    if t.dim() == 0:
        x = float(t)
        return None if x == -math.inf else x
    return [tensor_json(x) for x in t]


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None  # strict JSON: a -inf against a finite value is written null


def kernel_case(step: Step) -> dict[str, Any]:
    """A step's ``"kernel"``, any scenario's: per traced term, in the order the trace gives them, its reference
    values, the kernel's and their largest difference."""
    diff = step.kernel_diff
    return {
        "terms": [
            {
                "name": name,
                "reference": tensor_json(step[name]),
                "kernel": tensor_json(mine),
                "maxDiff": _finite_or_none(diff[name]),
            }
            for name, mine in step.kernel.items()
        ]
    }


def kernel_head(replay: Replay) -> dict[str, Any]:
    """The document's ``"kernel"``: what ran, its tile sizes, and what explains the differences."""
    source, note = SOURCES[replay.kernel]
    return {"source": source, "blockM": replay.block_m, "blockN": replay.block_n, "tiles": replay.note, "note": note}


def kernel_text(replay: Replay) -> str:
    """The table's line under the updates: what ran, its tiles, and what explains the differences."""
    source, note = SOURCES[replay.kernel]
    return f"Kernel: {source}. {replay.note} {note}".replace("  ", " ")


def build_view(replay: Replay, options: Mapping[str, Any]) -> dict[str, Any] | None:
    """The page panel's payload (the numbers are the cases' ``"kernel"``); None for a replay of the reference."""
    if replay.source != "triton":
        return None
    return kernel_head(replay) | {"rowStart": replay.rows[0]}


def _digits(t: Tensor) -> str:
    x = float(t)
    return "-inf" if x == -math.inf else f"{x:.8g}"


def kernel_table(step: Step, kernel: str = "core"):
    """The table's panel: per term (the tiles by their first row) the reference, the kernel and the difference."""
    from rich.table import Table

    title = f"Kernel ({SOURCES[kernel][0].split()[0]}) beside the reference"
    table = Table(box=None, pad_edge=False, title=title, title_justify="left")
    for column in ("term", "reference", "kernel", "max |difference|"):
        table.add_column(column, justify="left" if column == "term" else "right")
    r0 = step.rows[0]
    for name in KERNEL_TERMS:
        ref, mine = step[name], step.kernel[name]
        label = name if name in VECTORS else f"{name} (row {r0})"
        if name not in VECTORS:  # (Br, Bc) or (Br, D): the first row
            ref, mine = ref[0], mine[0]
        cells = [" ".join(_digits(x) for x in values) for values in (ref, mine)]
        table.add_row(label, *cells, f"{step.kernel_diff[name]:.3g}")
    return table


def kernel_lines(step: Step) -> list[str]:
    """The PNG's lines under an update's equations: per term, row ``r0``'s first value in both columns and the
    largest difference over the tile; none for a step of the reference alone."""
    if not step.kernel:
        return []
    lines = ["", "kernel beside the reference, first value of each term:"]
    for name in KERNEL_TERMS:
        ref, mine = step[name].reshape(-1)[0], step.kernel[name].reshape(-1)[0]
        diff = step.kernel_diff[name]
        lines.append(f"  {name:8s} {_digits(ref):>14s} {_digits(mine):>14s}   max |difference| {diff:.3g}")
    return lines
