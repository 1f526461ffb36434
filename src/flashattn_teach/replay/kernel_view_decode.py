"""The decode kernel's numbers beside the reference's (``replay_decode(..., source="triton")``,
:mod:`.kernel_trace_decode`), as every renderer shows them: the JSON's per-case and per-merge ``"kernel"``
(:func:`.kernel_view.kernel_case`) and the document's (:func:`decode_kernel_head`), the table's panels
(:func:`decode_kernel_table`), the page's panel (``page_kernel.js``, from the same JSON) and the PNG's lines under
the tables, per tile update and merge (:func:`decode_kernel_lines`).

Per step and per traced term, two columns and their difference:

    reference   the replay's own term (float64 from float64 inputs, else float32)
    kernel      the kernel's record of it, in base e (m_i and S_ij: base 2 times ln 2)
    difference  max |kernel - reference| over the term (equal infinities count 0)

A split's UPDATE traces ``S_ij, m_i, l_i, alpha, acc_new`` (its last also ``O_partial``, the kernel's partial
``O_s``); a MERGE the partials it merges (``O_a, lse_a`` on the first, ``O_b, lse_b``) and, on the last, the
kernel's merged ``O, lse``. The JSON writes every value; the table the vectors whole and a matrix's first row.
Eight significant digits: what differs is in the last ones.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from torch import Tensor

from .decode_replay import DecodeReplay
from .kernel_trace_decode import NOTE
from .kernel_view import tensor_json
from .step import Step, StepKind

__all__ = [
    "DECODE_KERNEL_SOURCE",
    "decode_kernel_head",
    "decode_kernel_lines",
    "decode_kernel_table",
]

DECODE_KERNEL_SOURCE = "triton/kernels/decode.py (the split-KV decode kernel), its trace build: TRACE=True"


def decode_kernel_head(r: DecodeReplay) -> dict[str, Any]:
    """The document's ``"kernel"``: what ran, its tiles and splits, its merged result against the replay's, and
    what explains the differences."""
    assert r.kernel is not None
    O, lse = r.kernel.trace.O.double(), r.kernel.trace.lse.double()
    return {
        "source": DECODE_KERNEL_SOURCE,
        "blockN": r.block_n,
        "numSplits": r.num_splits,
        "ranges": [list(keys) for keys in r.ranges],
        "output": tensor_json(O),
        "lse": tensor_json(lse),
        "maxDiffOutput": float((O - r.O.double()).abs().max()) if O.numel() else 0.0,
        "tiles": r.note,
        "note": NOTE,
    }


def _digits(t: Tensor) -> str:
    x = float(t)
    return "-inf" if x == -math.inf else f"{x:.8g}"


def _cells(t: Tensor) -> str:
    """A vector whole, a matrix by its first row."""
    return " ".join(_digits(x) for x in (t if t.dim() <= 1 else t[0]))


def decode_kernel_table(steps: Iterable[Step], title: str):
    """One table of ``steps``' traced terms: the step, the term, the reference, the kernel, the difference."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False, title=title, title_justify="left")
    for column in ("step", "term", "reference", "kernel", "max |difference|"):
        table.add_column(column, justify="left" if column in ("step", "term") else "right")
    for step in steps:
        label = f"update {step.index + 1}" if step.step_kind is StepKind.UPDATE else f"merge {step.label}"
        for name, mine in step.kernel.items():
            shown = name if mine.dim() <= 1 else f"{name} (row 0)"
            table.add_row(label, shown, _cells(step[name]), _cells(mine), f"{step.kernel_diff[name]:.3g}")
            label = ""
    return table


def decode_kernel_lines(r: DecodeReplay) -> list[list[str]]:
    """The PNG's lines, one block per tile update and merge: its label, then per traced term row 0's first value
    in both columns and the largest difference over the term; none for a replay of the reference."""
    if r.kernel is None:
        return []
    labelled = [(f"split {split.index} · update {step.index + 1}", step) for split in r.splits for step in split]
    labelled += [(f"merge {m.index + 1} · {m.label}", m) for m in r.merges]
    blocks = []
    for label, step in labelled:
        lines = [label]
        for name, mine in step.kernel.items():
            ref, first = step[name].reshape(-1)[0], mine.reshape(-1)[0]
            diff = step.kernel_diff[name]
            lines.append(f"  {name:9s} {_digits(ref):>15s} {_digits(first):>15s}   max |difference| {diff:.3g}")
        blocks.append(lines)
    return blocks
