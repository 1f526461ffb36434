"""No markdown table this part of the project owns presents an estimate as a result: in a table about
TFLOP/s and targets (the table, or the paragraph just above it, names TFLOP/s and a target or "met"), every
figure stands in a column or a row labelled "measured", "estimate" or "not measured" (or is the target
itself). Scanned: benchmarks/**/*.md, docs/*.md and README.md. The controls: the target table README.md had
before issue 37 (the loop profile's figures under compiler names, read as results) is flagged; the same
table labelled is not."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OWNED = [*sorted((ROOT / "benchmarks").rglob("*.md")), *sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
LABELS = ("measured", "estimate", "not measured")
TARGET_COLUMN = re.compile(r"\b(target|bound|met)\b", re.IGNORECASE)


def _tables(text: str) -> list[tuple[str, list[str]]]:
    """``(caption, table lines)`` for each markdown table; the caption is the paragraph above it."""
    out: list[tuple[str, list[str]]] = []
    lines = text.splitlines()
    n = 0
    while n < len(lines):
        if not lines[n].lstrip().startswith("|"):
            n += 1
            continue
        start = n
        while n < len(lines) and lines[n].lstrip().startswith("|"):
            n += 1
        end = start
        while end > 0 and not lines[end - 1].strip():
            end -= 1  # the blank line(s) between the caption and the table
        above = end
        while above > 0 and lines[above - 1].strip() and not lines[above - 1].lstrip().startswith("|"):
            above -= 1
        out.append((" ".join(lines[above:end]), lines[start:n]))
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def unlabelled_rows(text: str) -> list[str]:
    """Rows of TFLOP/s target tables with a figure in a column and row that no label names."""
    found = []
    for caption, table in _tables(text):
        whole = caption + "\n" + "\n".join(table)
        if not re.search(r"TFLOP/s|TF/s", whole) or not re.search(r"\btargets?\b|\bmet\b", whole, re.IGNORECASE):
            continue
        header = _cells(table[0])
        for line in table[1:]:
            cells = _cells(line)
            if all(set(c) <= set("-: ") for c in cells):
                continue  # the separator row
            for j, cell in enumerate(cells[1:], start=1):
                column = header[j] if j < len(header) else ""
                if not re.search(r"\d", cell) or TARGET_COLUMN.search(column):
                    continue
                if not any(label in (column + " " + cells[0] + " " + cell).lower() for label in LABELS):
                    found.append(line.strip())
                    break
    return found


BEFORE = """\
Targets of this round by the loop profile (`flashattn-teach kernels --arch sm90 --loops`, TFLOP/s):

| | target | triton 3.9 | triton 3.6 | before (3.6) |
|---|--:|--:|--:|--:|
| forward hd128 (warp-specialised) | >= 600 | 742 | 742 | 490 |
| backward hd128 (one kernel) | >= 450 | 449 | 447 | 334 |
"""
AFTER = """\
Targets of this round (TFLOP/s, H200, bf16, N = 8192):

| | target | measured | estimate, triton 3.9 | estimate, triton 3.6 |
|---|--:|--:|--:|--:|
| forward hd128 (warp-specialised) | >= 600 | not measured | 742 (uncalibrated) | 742 (uncalibrated) |
| backward hd128 (one kernel) | >= 450 | not measured | 390 (model, calibrated on H200 2026-11-30) | 388 |
"""


def test_the_check_flags_an_estimate_shown_as_a_result_and_passes_it_labelled() -> None:
    assert unlabelled_rows(BEFORE) == [BEFORE.splitlines()[4], BEFORE.splitlines()[5]]
    assert unlabelled_rows(AFTER) == []
    # a table with no target is out of scope; a CPU target table without TFLOP/s too
    assert unlabelled_rows(BEFORE.replace("Targets of this round", "Loops").replace("target", "x")) == []


@pytest.mark.parametrize("path", OWNED, ids=lambda p: str(p.relative_to(ROOT)))
def test_owned_markdown_labels_every_figure_of_a_target_table(path: Path) -> None:
    assert unlabelled_rows(path.read_text()) == [], path
