"""The equations of every forward update with their numbers, per query row of the replayed block.

For query block ``i`` and key block ``j``, row by row, the lines of FlashAttention-2's forward pass (Dao 2023,
Algorithm 1), each written three ways: symbolically, with this update's numbers substituted, and as its value:

    line 5   m_i = -inf, l_i = 0, acc = 0                  (the first update only; with a sink m_i = sink_h, l_i = 1)
    line 8   S_ij = scale * Q_i K_j^T                      (-inf where masked)
    line 9   m_new = max(m_old, rowmax(S_ij)),  alpha = exp(m_old - m_new),  P_ij = exp(S_ij - m_new),
             l_new = alpha * l_old + rowsum(P_ij)
    line 10  acc_new = alpha * acc_old + P_ij V_j
    line 12  O_i = acc / l_i                               (the block's last update only)
    line 13  lse_i = m_i + log(l_i)                        (the block's last update only)

The numbers are the replay's own (:class:`~flashattn_teach.trace.steps.TileStep` keeps the state before the
update and :class:`~flashattn_teach.online_softmax.UpdateTerms`), so the equations show what the code
computed. A row that has seen no key yet keeps ``m = -inf``; the code then takes the maximum as 0 in the
exponents (``alpha = exp(-inf - 0) = 0``, ``P_ij = exp(-inf - 0) = 0``) rather than compute ``-inf - (-inf)``,
and its equations say so in a note.

An equation's ``parts`` are its substituted text as strings and numbers (a float, ``-inf`` included, or a
tuple of floats for a row vector); renderers format the numbers themselves (the page with ``Page.fmt``),
``substituted`` joins them with 4 significant digits. In JSON ``-inf`` is ``null``, as in the manifest.

Key-major order (``replay(..., order="key_major")``) is FlashAttention's loop order (Dao et al. 2022, Algorithm 1):
the replay reads the state back from HBM before each tile (``acc = O_i * l_i``) and then computes FA2's form above,
which is what the case JSON lists for both orders. :func:`key_major_row_equations` writes the same update in FA1
Alg. 1's own form, with its HBM traffic:

    line 2   O = 0, l = 0, m = -inf in HBM                  (the first update only; with a sink m_i = sink_h, l_i = 1)
    line 8   load O_i, l_i, m_i from HBM
    line 9   S_ij = tau Q_i K_j^T                           (tau = scale, as in FA1 Alg. 2; -inf where masked)
    line 10  m~_ij = rowmax(S_ij),  P~_ij = exp(S_ij - m~_ij),  l~_ij = rowsum(P~_ij)
    line 11  m_new = max(m_i, m~_ij),  l_new = exp(m_i - m_new) l_i + exp(m~_ij - m_new) l~_ij
    line 12  write O_i <- diag(l_new)^-1 (diag(l_i) exp(m_i - m_new) O_i + exp(m~_ij - m_new) P~_ij V_j) to HBM
    line 13  write l_i <- l_new, m_i <- m_new to HBM

Its inputs are the replay's (``S_ij``, ``V_j`` and the state read back); its tile terms (``m~_ij, P~_ij, l~_ij``,
``P~_ij V_j``, the two rescale factors) are computed here in FA1's form, and its results are the replay's own
``m_i, l_i, O_partial``, which FA1's form reproduces to rounding. A ``-inf`` maximum (``m_new``, or ``m~_ij`` of a
row whose keys in this tile are all masked) is taken as 0 in the exponents, as the code's ``m_safe``.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import Tensor

from ..online_softmax import log_sum_exp, normalize
from .replay import Replay
from .steps import TileStep

__all__ = [
    "KEY_MAJOR_LINES",
    "KEY_MAJOR_SOURCE",
    "SOURCE",
    "Equation",
    "KeyMajorTerm",
    "Term",
    "build_view",
    "compact",
    "fmt",
    "key_major_row_equations",
    "key_major_step_equations",
    "key_major_step_json",
    "lines",
    "row_equations",
    "step_equations",
    "step_json",
]

SOURCE = "Dao 2023, FlashAttention-2, Algorithm 1"
KEY_MAJOR_SOURCE = "Dao et al. 2022, FlashAttention, Algorithm 1"
NO_KEY = "no key seen yet: m_new = −∞ is taken as 0 in the exponents, so the code never computes −∞ − (−∞)"

Number = float | tuple[float, ...]  # a scalar or one row of a tile, -inf included
Part = str | Number


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


class KeyMajorTerm(Enum):
    """One equation of FA1 Alg. 1 (key-major order), by the name of what it computes; ``KEY_MAJOR_LINES``
    gives its line."""

    M_INIT = "init m_i"
    L_INIT = "init l_i"
    O_INIT = "init O_i"
    M_LOAD = "load m_i"
    L_LOAD = "load l_i"
    O_LOAD = "load O_i"
    S_IJ = "S_ij"
    M_TILE = "m~_ij"
    P_TILE = "P~_ij"
    L_TILE = "l~_ij"
    M_NEW = "m_new"
    SCALE_OLD = "exp(m_i - m_new)"
    SCALE_TILE = "exp(m~_ij - m_new)"
    L_NEW = "l_new"
    PV = "P~_ij V_j"
    O_WRITE = "write O_i"
    L_WRITE = "write l_i"
    M_WRITE = "write m_i"


KEY_MAJOR_LINES = {
    **dict.fromkeys((KeyMajorTerm.M_INIT, KeyMajorTerm.L_INIT, KeyMajorTerm.O_INIT), 2),
    **dict.fromkeys((KeyMajorTerm.M_LOAD, KeyMajorTerm.L_LOAD, KeyMajorTerm.O_LOAD), 8),
    KeyMajorTerm.S_IJ: 9,
    **dict.fromkeys((KeyMajorTerm.M_TILE, KeyMajorTerm.P_TILE, KeyMajorTerm.L_TILE), 10),
    **dict.fromkeys((KeyMajorTerm.M_NEW, KeyMajorTerm.SCALE_OLD, KeyMajorTerm.SCALE_TILE, KeyMajorTerm.L_NEW), 11),
    **dict.fromkeys((KeyMajorTerm.PV, KeyMajorTerm.O_WRITE), 12),
    **dict.fromkeys((KeyMajorTerm.L_WRITE, KeyMajorTerm.M_WRITE), 13),
}


def fmt(x: float) -> str:
    """4 significant digits, ``-inf`` as ``−∞`` (as the page's ``Page.fmt``)."""
    return "−∞" if x == -math.inf else f"{x:.4g}"


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
    """One line of FA2 Alg. 1 (a :class:`Term`) or of FA1 Alg. 1 (a :class:`KeyMajorTerm`) for one row:
    ``symbolic``, then ``parts`` (text and numbers) ending in ``value``."""

    term: Term | KeyMajorTerm
    symbolic: str
    parts: tuple[Part, ...]
    value: Number
    note: str | None = None

    @property
    def line(self) -> int:
        return LINES[self.term] if isinstance(self.term, Term) else KEY_MAJOR_LINES[self.term]

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


def row_equations(step: TileStep, r: int) -> tuple[Equation, ...]:
    """The equations of row ``r`` of the block (0-based within it) at ``step``, in Alg. 1's order."""
    t = step.terms
    m_old, l_old = float(step.m_old[r]), float(step.l_old[r])
    m_new, alpha, rowmax = float(t.m_new[r]), float(t.alpha[r]), float(t.rowmax[r])
    l_new, rowsum = float(t.l_new[r]), float(t.rowsum[r])
    S, P = tuple(step.S_ij[r].tolist()), tuple(t.P_ij[r].tolist())
    acc_old, PV, acc = tuple(step.acc_old[r].tolist()), tuple(t.PV[r].tolist()), tuple(t.acc_new[r].tolist())
    no_key = m_new == -math.inf
    # The code's m_safe: 0 where m_new = -inf; a negative m_new in parentheses after the minus.
    shifted: tuple[Part, ...] = (" − 0",) if no_key else (" − (", m_new, ")") if m_new < 0 else (" − ", m_new)
    note = NO_KEY if no_key else None
    eqs: list[Equation] = []
    if step.index == 0:
        sink = step.sink_share is not None
        eqs += [
            Equation(Term.M_START, "m_i = sink_h" if sink else "m_i = −∞", ("m_i = ", m_old), m_old),
            Equation(Term.L_START, "l_i = exp(sink_h − m_i) = 1" if sink else "l_i = 0", ("l_i = ", l_old), l_old),
        ]
    eqs += [
        Equation(Term.S_IJ, "S_ij = scale · Q_i K_j^T  (−∞ where masked)", ("S_ij = ", S), S),
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
        eqs += _finish(t.m_new[r : r + 1], t.l_new[r : r + 1], t.acc_new[r : r + 1])
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


def step_equations(step: TileStep) -> tuple[tuple[Equation, ...], ...]:
    """Every row's equations at ``step``."""
    return tuple(row_equations(step, r) for r in range(step.rows[1] - step.rows[0]))


def step_json(step: TileStep) -> dict[str, Any]:
    """A case's ``"equations"``: ``rowStart`` and, per row of the block, its equations as dicts."""
    return {"rowStart": step.rows[0], "rows": [[e.to_json() for e in row] for row in step_equations(step)]}


def _minus(m: float) -> tuple[Part, ...]:
    """`` − m`` in an exponent, with the code's ``m_safe``: `` − 0`` for ``m = -inf``, ``(m)`` when negative."""
    return (" − 0",) if m == -math.inf else (" − (", m, ")") if m < 0 else (" − ", m)


def key_major_row_equations(step: TileStep, r: int, v_j: Tensor) -> tuple[Equation, ...]:
    """FA1 Alg. 1's lines for row ``r`` of the block (0-based within it) at ``step`` of a key-major replay, with
    ``v_j (Bc, D_v)`` the tile's values. The tile terms are computed here in FA1's form; ``m_new, l_new`` and the
    written ``O_i`` are the replay's own (``terms.m_new, terms.l_new``, ``O_partial``)."""
    t = step.terms
    m_old, l_old, m_new = float(step.m_old[r]), float(step.l_old[r]), float(t.m_new[r])
    l_new, scale_old = float(t.l_new[r]), float(t.alpha[r])  # alpha = exp(m_old - m_new): FA1's first factor
    O_old = normalize(step.l_old[r : r + 1], step.acc_old[r : r + 1])[0]  # (D_v,): acc was read back as O_i * l_i
    m_tile = float(t.rowmax[r])
    # FA1 Alg. 1 line 10 on the tile alone, -inf taken as 0 in the exponent as the code's m_safe does.
    P_tile = torch.exp(step.S_ij[r] - (0.0 if m_tile == -math.inf else m_tile))  # (Bc,)
    l_tile = float(P_tile.sum())
    scale_tile = math.exp(m_tile - (0.0 if m_new == -math.inf else m_new))
    PV = P_tile @ v_j  # (Bc,) @ (Bc, D_v) -> (D_v,)
    S, P, O, O_new = (tuple(x.tolist()) for x in (step.S_ij[r], P_tile, O_old, step.O_partial[r]))
    PV_ = tuple(PV.tolist())
    no_key = NO_KEY if m_new == -math.inf else None
    tile_empty = "no visible key in this tile: m̃_ij = −∞ is taken as 0 in the exponent, so P̃_ij = 0"
    eqs: list[Equation] = []
    if step.index == 0:
        sink = step.sink_share is not None
        eqs += [
            Equation(KeyMajorTerm.M_INIT, "m_i = sink_h" if sink else "m_i = −∞  (in HBM)", ("m_i = ", m_old), m_old),
            Equation(KeyMajorTerm.L_INIT, "l_i = 1" if sink else "l_i = 0  (in HBM)", ("l_i = ", l_old), l_old),
            Equation(KeyMajorTerm.O_INIT, "O_i = 0  (in HBM)", ("O_i = ", O), O),
        ]
    eqs += [
        Equation(KeyMajorTerm.M_LOAD, "load m_i from HBM", ("m_i = ", m_old), m_old),
        Equation(KeyMajorTerm.L_LOAD, "load l_i from HBM", ("l_i = ", l_old), l_old),
        Equation(KeyMajorTerm.O_LOAD, "load O_i from HBM", ("O_i = ", O), O),
        Equation(KeyMajorTerm.S_IJ, "S_ij = τ Q_i K_j^T  (τ = scale; −∞ where masked)", ("S_ij = ", S), S),
        Equation(KeyMajorTerm.M_TILE, "m̃_ij = rowmax(S_ij)", ("rowmax(", S, ") = ", m_tile), m_tile),
        Equation(
            KeyMajorTerm.P_TILE,
            "P̃_ij = exp(S_ij − m̃_ij)",
            ("exp(", S, *_minus(m_tile), ") = ", P),
            P,
            tile_empty if m_tile == -math.inf else None,
        ),
        Equation(KeyMajorTerm.L_TILE, "l̃_ij = rowsum(P̃_ij)", ("rowsum(", P, ") = ", l_tile), l_tile),
        Equation(KeyMajorTerm.M_NEW, "m_new = max(m_i, m̃_ij)", ("max(", m_old, ", ", m_tile, ") = ", m_new), m_new),
        Equation(
            KeyMajorTerm.SCALE_OLD,
            "exp(m_i − m_new)",
            ("exp(", m_old, *_minus(m_new), ") = ", scale_old),
            scale_old,
            no_key,
        ),
        Equation(
            KeyMajorTerm.SCALE_TILE,
            "exp(m̃_ij − m_new)",
            ("exp(", m_tile, *_minus(m_new), ") = ", scale_tile),
            scale_tile,
            no_key,
        ),
        Equation(
            KeyMajorTerm.L_NEW,
            "l_new = exp(m_i − m_new) l_i + exp(m̃_ij − m_new) l̃_ij",
            (scale_old, " · ", l_old, " + ", scale_tile, " · ", l_tile, " = ", l_new),
            l_new,
        ),
        Equation(KeyMajorTerm.PV, "P̃_ij V_j", (P, " V_j = ", PV_), PV_),
    ]
    O_sym = "O_i ← diag(l_new)⁻¹ (diag(l_i) exp(m_i − m_new) O_i + exp(m̃_ij − m_new) P̃_ij V_j)  (to HBM)"
    inner = ("(", l_old, " · ", scale_old, " · ", O, " + ", scale_tile, " · ", PV_, ")")
    if l_new == 0:
        empty = "l_new = 0: the row has seen no key; the code divides by 1 there, so O_i = 0"
        eqs.append(Equation(KeyMajorTerm.O_WRITE, O_sym, (*inner, " / 1 = ", O_new), O_new, empty))
    else:
        eqs.append(Equation(KeyMajorTerm.O_WRITE, O_sym, (*inner, " / ", l_new, " = ", O_new), O_new))
    eqs += [
        Equation(KeyMajorTerm.L_WRITE, "l_i ← l_new  (to HBM)", ("l_i = ", l_new), l_new),
        Equation(KeyMajorTerm.M_WRITE, "m_i ← m_new  (to HBM)", ("m_i = ", m_new), m_new),
    ]
    return tuple(eqs)


def key_major_step_equations(step: TileStep, v_j: Tensor) -> tuple[tuple[Equation, ...], ...]:
    """Every row's FA1 Alg. 1 equations at ``step`` (``v_j (Bc, D_v)``: the tile's values)."""
    return tuple(key_major_row_equations(step, r, v_j) for r in range(step.rows[1] - step.rows[0]))


def key_major_step_json(step: TileStep, v_j: Tensor) -> dict[str, Any]:
    """As :func:`step_json`, with FA1 Alg. 1's lines."""
    rows = key_major_step_equations(step, v_j)
    return {"rowStart": step.rows[0], "rows": [[e.to_json() for e in row] for row in rows]}


def compact(eqs: tuple[Equation, ...]) -> str:
    """One line for a row: its ``alpha``, ``l_new`` and (at the end) ``lse_i`` equations with their numbers."""
    shown = (Term.ALPHA, Term.L_NEW, Term.LSE)
    return ";  ".join(f"{e.term.value} = {e.substituted}" for e in eqs if e.term in shown)


def lines(step: TileStep, width: int = 100) -> list[str]:
    """``step``'s equations as plain text lines of at most about ``width`` characters: the block's first row
    in full, one compact line per other row (for the PNG)."""
    rows = step_equations(step)
    r0 = step.rows[0]
    out = [f"FA2 Alg. 1 ({SOURCE.split(', ')[0]}), row {r0}:"]
    for e in rows[0] if rows else ():
        text = f"line {e.line:>2}  {e.symbolic}:  {e.substituted}" + (f"  ({e.note})" if e.note else "")
        out += textwrap.wrap(text, width, subsequent_indent=" " * 9)
    for r, eqs in enumerate(rows[1:], start=1):
        out += textwrap.wrap(f"row {r0 + r}: {compact(eqs)}", width, subsequent_indent=" " * 9)
    return out


def build_view(replay: Replay, options: Mapping[str, Any]) -> dict[str, Any] | None:
    """The equations panel's payload; None without updates. Query-major: the numbers are in each case's
    ``"equations"``. Key-major: ``"steps"`` lists, per update, FA1 Alg. 1's lines (:func:`key_major_step_json`),
    which the panel shows instead, and ``"note"`` says how they relate to the case's FA2 lines."""
    if len(replay.steps) == 0:
        return None
    r0, r1 = replay.rows
    if replay.order != "key_major":
        return {"source": SOURCE, "rowStart": r0, "rowCount": r1 - r0}
    v = replay.steps.v  # (N_k, D_v): the replayed head's values
    return {
        "source": KEY_MAJOR_SOURCE,
        "rowStart": r0,
        "rowCount": r1 - r0,
        "note": "key-major order: the state goes to HBM between tiles. The replay reads it back as acc = O_i · l_i "
        "and updates it in FA2's form (the JSON's equations); FA1's form below gives the same m_i, l_i and O_i.",
        "steps": [key_major_step_json(s, v[s.cols[0] : s.cols[1]]) for s in replay.steps],
    }
