"""The equations of every forward update with their numbers, per query row of the replayed block.

For query block ``i`` and key block ``j``, row by row, the lines of FlashAttention-2's forward pass (Dao 2023,
Algorithm 1), each written three ways: symbolically, with this update's numbers substituted, and as its value:

    line 5   m_i = -inf, l_i = 0, acc = 0                  (the first update only; with a sink m_i = sink_h, l_i = 1)
    line 8   S_ij = scale * Q_i K_j^T                      (-inf where masked; capped and biased as the call asks:
                                                            softcap * tanh(scale * Q_i K_j^T / softcap) + bias_ij)
    line 9   m_new = max(m_old, rowmax(S_ij)),  alpha = exp(m_old - m_new),  P_ij = exp(S_ij - m_new),
             l_new = alpha * l_old + rowsum(P_ij)
    line 10  acc_new = alpha * acc_old + P_ij V_j
    line 12  O_i = acc / l_i                               (the block's last update only)
    line 13  lse_i = m_i + log(l_i)                        (the block's last update only)

The numbers are the replay's own (:class:`~flashattn_teach.replay.steps.Step` keeps the state before the
update and :class:`~flashattn_teach.core.online_softmax.UpdateTerms`), so the equations show what the code
computed. A row that has seen no key yet keeps ``m = -inf``; the code then takes the maximum as 0 in the
exponents (``alpha = exp(-inf - 0) = 0``, ``P_ij = exp(-inf - 0) = 0``) rather than compute ``-inf - (-inf)``,
and its equations say so in a note.

An equation's ``parts`` are its substituted text as strings and numbers (a float, ``-inf`` included, or a
tuple of floats for a row vector); renderers format the numbers themselves (the page with ``Page.fmt``),
``substituted`` joins them with 4 significant digits. In JSON ``-inf`` is ``null``, as in the manifest.

Key-major order's own lines (FA1 Alg. 1) are in :mod:`.equations_key_major`, with the panel's payload.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, overload

from ..core.online_softmax import log_sum_exp, normalize
from .step import Step

__all__ = [
    "COMPACT",
    "SOURCE",
    "AlgorithmLine",
    "Equation",
    "Part",
    "ShownEquations",
    "Term",
    "compact",
    "fmt",
    "lines",
    "row_equations",
    "score_symbolic",
    "shown_equations",
    "step_equations",
    "step_json",
]

SOURCE = "Dao 2023, FlashAttention-2, Algorithm 1"
BIAS = "bias_ij: the call's additive term of this score, ALiBi's and/or an additive attn_mask's"
NO_KEY = "no key seen yet: m_new = −∞ is taken as 0 in the exponents, so the code never computes −∞ − (−∞)"

Number = float | tuple[float, ...]  # a scalar or one row of a tile, -inf included
Part = str | Number


class AlgorithmLine(Protocol):
    """What an equation computes: its name (``value``) and its line in the algorithm (``line``)."""

    @property
    def value(self) -> str: ...

    @property
    def line(self) -> int: ...


class Term(Enum):
    """One equation of FA2 Alg. 1, by the name of what it computes; ``LINES`` gives its line."""

    M_START = "m_i"
    L_START = "l_i"
    S_IJ = "S_ij"
    ROWMAX = "rowmax"
    M_NEW = "m_new"
    ALPHA = "alpha"
    P_IJ = "P_ij"
    ROWSUM = "rowsum"
    L_NEW = "l_new"
    PV = "P_ij V_j"
    ACC = "acc"
    O_I = "O_i"
    LSE = "lse_i"

    @property
    def line(self) -> int:
        return LINES[self]


LINES = {
    Term.M_START: 5,
    Term.L_START: 5,
    Term.S_IJ: 8,
    Term.ROWMAX: 9,
    Term.M_NEW: 9,
    Term.ALPHA: 9,
    Term.P_IJ: 9,
    Term.ROWSUM: 9,
    Term.L_NEW: 9,
    Term.PV: 10,
    Term.ACC: 10,
    Term.O_I: 12,
    Term.LSE: 13,
}


def fmt(x: float) -> str:
    """4 significant digits, ``-inf`` as ``−∞`` (as the page's ``Page.fmt``), ``-0`` as ``0``."""
    return "−∞" if x == -math.inf else f"{x + 0.0:.4g}"  # -0.0 + 0.0 = +0.0


def _text(part: Part) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, tuple):
        return "[" + ", ".join(fmt(x) for x in part) + "]"
    return fmt(part)


def _json_number(x: float) -> float | None:
    return None if x == -math.inf else x


def _json(part: Part) -> Any:
    if isinstance(part, str):
        return part
    if isinstance(part, tuple):
        return [_json_number(x) for x in part]
    return _json_number(part)


@dataclass(frozen=True)
class Equation:
    """One line of FA2 Alg. 1 (a :class:`Term`) or of FA1 Alg. 1 (:class:`.equations_key_major.KeyMajorTerm`)
    for one row: ``symbolic``, then ``parts`` (text and numbers) ending in ``value``."""

    term: AlgorithmLine
    symbolic: str
    parts: tuple[Part, ...]
    value: Number
    note: str | None = None

    @property
    def line(self) -> int:
        return self.term.line

    @property
    def substituted(self) -> str:
        return "".join(_text(p) for p in self.parts)

    def to_json(self) -> dict[str, Any]:
        out = {
            "line": self.line,
            "name": self.term.value,
            "symbolic": self.symbolic,
            "substituted": self.substituted,
            "parts": [_json(p) for p in self.parts],
            "value": _json(self.value),
        }
        if self.note is not None:
            out["note"] = self.note
        return out


def score_symbolic(step: Step) -> str:
    """Line 8 as this step computed ``S_ij`` (:func:`flashattn_teach.reference.scores.score_tile`): capped, then
    biased, then masked, so that the formula gives the numbers shown."""
    score, where = "scale · Q_i K_j^T", "−∞ where masked"
    if step.softcap is not None:
        score, where = f"softcap · tanh({score} / softcap)", f"softcap = {step.softcap:g}; {where}"
    if step.biased:
        score += " + bias_ij"
    return f"S_ij = {score}  ({where})"


def row_equations(step: Step, r: int) -> tuple[Equation, ...]:
    """The equations of row ``r`` of the block (0-based within it) at UPDATE ``step``, in Alg. 1's order."""
    m_old, l_old = float(step["m_old"][r]), float(step["l_old"][r])
    m_new, alpha, rowmax = float(step["m_new"][r]), float(step["alpha"][r]), float(step["rowmax"][r])
    l_new, rowsum = float(step["l_new"][r]), float(step["rowsum"][r])
    S, P = tuple(step["S_ij"][r].tolist()), tuple(step["P_ij"][r].tolist())
    acc_old, PV = tuple(step["acc_old"][r].tolist()), tuple(step["PV"][r].tolist())
    acc = tuple(step["acc_new"][r].tolist())
    no_key = m_new == -math.inf
    # The code's m_safe: 0 where m_new = -inf; a negative m_new in parentheses after the minus.
    shifted: tuple[Part, ...] = (" − 0",) if no_key else (" − (", m_new, ")") if m_new < 0 else (" − ", m_new)
    note = NO_KEY if no_key else None
    eqs: list[Equation] = []
    if step.index == 0:
        sink = step.get("sink_share") is not None
        eqs += [
            Equation(Term.M_START, "m_i = sink_h" if sink else "m_i = −∞", ("m_i = ", m_old), m_old),
            Equation(Term.L_START, "l_i = exp(sink_h − m_i) = 1" if sink else "l_i = 0", ("l_i = ", l_old), l_old),
        ]
    eqs += [
        Equation(Term.S_IJ, score_symbolic(step), ("S_ij = ", S), S, BIAS if step.biased else None),
        Equation(Term.ROWMAX, "rowmax(S_ij)", ("rowmax(", S, ") = ", rowmax), rowmax),
        Equation(Term.M_NEW, "m_new = max(m_old, rowmax(S_ij))", ("max(", m_old, ", ", rowmax, ") = ", m_new), m_new),
        Equation(Term.ALPHA, "alpha = exp(m_old − m_new)", ("exp(", m_old, *shifted, ") = ", alpha), alpha, note),
        Equation(Term.P_IJ, "P_ij = exp(S_ij − m_new)", ("exp(", S, *shifted, ") = ", P), P, note),
        Equation(Term.ROWSUM, "rowsum(P_ij)", ("rowsum(", P, ") = ", rowsum), rowsum),
        Equation(
            Term.L_NEW,
            "l_new = alpha · l_old + rowsum(P_ij)",
            (alpha, " · ", l_old, " + ", rowsum, " = ", l_new),
            l_new,
        ),
        Equation(Term.PV, "P_ij V_j", (P, " V_j = ", PV), PV),
        Equation(Term.ACC, "acc_new = alpha · acc_old + P_ij V_j", (alpha, " · ", acc_old, " + ", PV, " = ", acc), acc),
    ]
    if step.last:
        eqs += _finish(step["m_new"][r : r + 1], step["l_new"][r : r + 1], step["acc_new"][r : r + 1])
    return tuple(eqs)


def _finish(m_i, l_i, acc) -> list[Equation]:
    """Lines 12-13 for one row (``m_i, l_i (1,)``, ``acc (1, D_v)``), as :func:`online_softmax.finalize`."""
    O_i, lse = tuple(normalize(l_i, acc)[0].tolist()), float(log_sum_exp(m_i, l_i)[0])
    m, l, a = float(m_i[0]), float(l_i[0]), tuple(acc[0].tolist())
    if l == 0:
        empty = "l_i = 0: the row saw no key; the code divides by 1 there, so O_i = 0, and lse_i = −∞"
        return [
            Equation(Term.O_I, "O_i = acc / l_i", (a, " / 1 = ", O_i), O_i, empty),
            Equation(Term.LSE, "lse_i = m_i + log(l_i)", ("l_i = 0, so lse_i = ", lse), lse, empty),
        ]
    return [
        Equation(Term.O_I, "O_i = acc / l_i", (a, " / ", l, " = ", O_i), O_i),
        Equation(Term.LSE, "lse_i = m_i + log(l_i)", (m, " + log(", l, ") = ", lse), lse),
    ]


class RowEquations(Sequence[tuple[Equation, ...]]):
    """An UPDATE step's equations, one tuple of FA2 Alg. 1's lines per query row of its block, computed when a
    row is read (a block of ``Br`` rows holds ``O(Br (Bc + D_v))`` numbers per row's lines): ``step.equations``."""

    def __init__(self, step: Step, row: Callable[[Step, int], tuple[Equation, ...]] | None = None) -> None:
        self._step = step
        self._row = row_equations if row is None else row  # FA2 Alg. 1's; key-major: FA1 Alg. 1's

    def __len__(self) -> int:
        return self._step.rows[1] - self._step.rows[0]

    @overload
    def __getitem__(self, r: int) -> tuple[Equation, ...]: ...

    @overload
    def __getitem__(self, r: slice) -> Sequence[tuple[Equation, ...]]: ...

    def __getitem__(self, r: int | slice) -> tuple[Equation, ...] | Sequence[tuple[Equation, ...]]:
        if isinstance(r, slice):
            return [self[n] for n in range(len(self))[r]]
        if not -len(self) <= r < len(self):
            raise IndexError(f"row {r} out of range: the block has {len(self)} rows")
        return self._row(self._step, r % len(self))


def step_equations(step: Step) -> tuple[tuple[Equation, ...], ...]:
    """Every row's FA2 Alg. 1 equations at UPDATE ``step`` (what a query-major step carries as
    ``step.equations``; a key-major one carries FA1's)."""
    return tuple(row_equations(step, r) for r in range(step.rows[1] - step.rows[0]))


def step_json(step: Step) -> dict[str, Any]:
    """A case's ``"equations"``: ``rowStart`` and, per row of the block, its FA2 Alg. 1 equations as dicts (in
    either order: a key-major page shows FA1's beside them)."""
    return {"rowStart": step.rows[0], "rows": [[e.to_json() for e in row] for row in step_equations(step)]}


COMPACT = (Term.ALPHA, Term.L_NEW, Term.LSE)  # a compact row line: alpha, l_new and (at the end) lse_i


def compact(eqs: tuple[Equation, ...], shown: tuple[AlgorithmLine, ...] = COMPACT) -> str:
    """One line for a row: its ``shown`` equations (by default ``alpha``, ``l_new`` and, at the end, ``lse_i``)
    with their numbers."""
    return ";  ".join(f"{e.term.value} = {e.substituted}" for e in eqs if e.term in shown)


@dataclass(frozen=True)
class ShownEquations:
    """What the table and the PNG show of one update: the ``algorithm``'s lines (``"FA2 Alg. 1"``, from
    ``source``) for every row of the block from ``row_start``, the first row in full and one :func:`compact`
    line of the ``compact_terms`` per other row. FA2's: :func:`shown_equations`; key-major's (FA1 Alg. 1):
    :func:`.equations_view.replay_equations`."""

    algorithm: str
    source: str
    row_start: int
    rows: tuple[tuple[Equation, ...], ...]
    compact_terms: tuple[AlgorithmLine, ...] = COMPACT

    @property
    def title(self) -> str:
        return f"{self.algorithm} ({self.source.split(', ')[0]}), row {self.row_start}"

    def compact(self, r: int) -> str:
        """Row ``r`` of the block (0-based within it) on one line."""
        return compact(self.rows[r], self.compact_terms)

    def lines(self, width: int = 100) -> list[str]:
        """Plain text lines of at most about ``width`` characters (for the PNG)."""
        out = [f"{self.title}:"]
        for e in self.rows[0] if self.rows else ():
            text = f"line {e.line:>2}  {e.symbolic}:  {e.substituted}" + (f"  ({e.note})" if e.note else "")
            out += textwrap.wrap(text, width, subsequent_indent=" " * 9)
        for r in range(1, len(self.rows)):
            out += textwrap.wrap(f"row {self.row_start + r}: {self.compact(r)}", width, subsequent_indent=" " * 9)
        return out


def shown_equations(step: Step) -> ShownEquations:
    """FA2 Alg. 1's lines of ``step``, as the table and the PNG show them."""
    return ShownEquations("FA2 Alg. 1", SOURCE, step.rows[0], step_equations(step))


def lines(step: Step, width: int = 100) -> list[str]:
    """``step``'s FA2 equations as plain text lines of at most about ``width`` characters: the block's first row
    in full, one compact line per other row (for the PNG)."""
    return shown_equations(step).lines(width)
