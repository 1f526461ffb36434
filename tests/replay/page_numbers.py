"""How the replay pages write numbers, for the browser tests: ``Page.fmt``'s four significant digits, ``−∞``
for ``-inf`` (``None`` in the JSON), and an equation's numbers read from its JSON parts."""

from __future__ import annotations

import math

MINUS_INFINITY = "\u2212\u221e"  # Page.fmt's -inf


def shown(text: str) -> float | None:
    """The number a page shows; None for ``−∞``."""
    return None if text == MINUS_INFINITY else float(text)


def assert_shown(text: str, x: float | None) -> None:
    """``text`` is the JSON's ``x`` to four significant digits (``x`` None: ``−∞``)."""
    if x is None:
        assert shown(text) is None, text
        return
    assert len(text.lstrip("-").replace(".", "").split("e")[0].lstrip("0")) <= 4, text
    assert math.isclose(shown(text), x, rel_tol=5.01e-4, abs_tol=1e-300), (text, x)


def assert_numbers(cells: list[list[str]], values) -> None:
    """A table's cells are the JSON's matrix (or vector, one row) to four significant digits."""
    rows = values if isinstance(values[0], list) else [values]
    assert len(cells) == len(rows)
    for texts, row in zip(cells, rows, strict=True):
        assert len(texts) == len(row)
        for text, x in zip(texts, row, strict=True):
            assert_shown(text, x)


def part_numbers(parts: list) -> list[float | None]:
    """The numbers of an equation's JSON parts, in order (rows flattened; None is -inf)."""
    out: list[float | None] = []
    for p in parts:
        if isinstance(p, list):
            out.extend(p)
        elif not isinstance(p, str):
            out.append(p)
    return out
