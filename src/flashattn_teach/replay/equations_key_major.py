"""FlashAttention's Algorithm 1 (Dao et al. 2022) with its numbers: the key-major order's equations (what a key-major
UPDATE step carries; the panel's payload and the lines the table and the picture show: :mod:`.equations_view`).

Key-major order (``replay(..., order="key_major")``) is FlashAttention's loop order (Dao et al. 2022, Algorithm 1):
the replay reads the state back from HBM before each tile (``acc = O_i * l_i``) and then computes FA2's form
(:mod:`.equations`), which is what the case JSON lists for both orders. :func:`key_major_row_equations` writes
the same update in FA1 Alg. 1's own form, with its HBM traffic:

    line 2   O = 0, l = 0, m = -inf in HBM                  (the first update only; with a sink m_i = sink_h, l_i = 1)
    line 8   load O_i, l_i, m_i from HBM
    line 9   S_ij = scale * Q_i K_j^T                       (FA1's tau is the scale; -inf where masked; capped and
                                                            biased as the call asks, as FA2's line 8)
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
from enum import Enum
from typing import Any

import torch

from ..core.online_softmax import normalize
from .equations import BIAS, NO_KEY, Equation, Part, score_symbolic
from .step import Step

__all__ = [
    "KEY_MAJOR_COMPACT",
    "KEY_MAJOR_LINES",
    "KEY_MAJOR_SOURCE",
    "KeyMajorTerm",
    "key_major_row_equations",
    "key_major_step_json",
]

KEY_MAJOR_SOURCE = "Dao et al. 2022, FlashAttention, Algorithm 1"


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

    @property
    def line(self) -> int:
        return KEY_MAJOR_LINES[self]


KEY_MAJOR_LINES = {
    **dict.fromkeys((KeyMajorTerm.M_INIT, KeyMajorTerm.L_INIT, KeyMajorTerm.O_INIT), 2),
    **dict.fromkeys((KeyMajorTerm.M_LOAD, KeyMajorTerm.L_LOAD, KeyMajorTerm.O_LOAD), 8),
    KeyMajorTerm.S_IJ: 9,
    **dict.fromkeys((KeyMajorTerm.M_TILE, KeyMajorTerm.P_TILE, KeyMajorTerm.L_TILE), 10),
    **dict.fromkeys((KeyMajorTerm.M_NEW, KeyMajorTerm.SCALE_OLD, KeyMajorTerm.SCALE_TILE, KeyMajorTerm.L_NEW), 11),
    **dict.fromkeys((KeyMajorTerm.PV, KeyMajorTerm.O_WRITE), 12),
    **dict.fromkeys((KeyMajorTerm.L_WRITE, KeyMajorTerm.M_WRITE), 13),
}


def _minus(m: float) -> tuple[Part, ...]:
    """`` − m`` in an exponent, with the code's ``m_safe``: `` − 0`` for ``m = -inf``, ``(m)`` when negative."""
    return (" − 0",) if m == -math.inf else (" − (", m, ")") if m < 0 else (" − ", m)


def key_major_row_equations(step: Step, r: int) -> tuple[Equation, ...]:
    """FA1 Alg. 1's lines for row ``r`` of the block (0-based within it) at UPDATE ``step`` of a key-major
    replay. The tile terms are computed here in FA1's form, with the tile's values ``V_j (Bc, D_v)``; ``m_new,
    l_new`` and the written ``O_i`` are the replay's own (the step's ``m_new, l_new`` and ``O_partial``)."""
    m_old, l_old, m_new = float(step["m_old"][r]), float(step["l_old"][r]), float(step["m_new"][r])
    l_new, scale_old = float(step["l_new"][r]), float(step["alpha"][r])  # alpha = exp(m_old - m_new): FA1's factor
    O_old = normalize(step["l_old"][r : r + 1], step["acc_old"][r : r + 1])[0]  # (D_v,): acc read back as O_i l_i
    m_tile = float(step["rowmax"][r])
    # FA1 Alg. 1 line 10 on the tile alone, -inf taken as 0 in the exponent as the code's m_safe does.
    P_tile = torch.exp(step["S_ij"][r] - (0.0 if m_tile == -math.inf else m_tile))  # (Bc,)
    l_tile = float(P_tile.sum())
    scale_tile = math.exp(m_tile - (0.0 if m_new == -math.inf else m_new))
    PV = P_tile @ step["V_j"]  # (Bc,) @ (Bc, D_v) -> (D_v,)
    S, P, O, O_new = (tuple(x.tolist()) for x in (step["S_ij"][r], P_tile, O_old, step["O_partial"][r]))
    PV_ = tuple(PV.tolist())
    no_key = NO_KEY if m_new == -math.inf else None
    tile_empty = "no visible key in this tile: m̃_ij = −∞ is taken as 0 in the exponent, so P̃_ij = 0"
    eqs: list[Equation] = []
    if step.index == 0:
        sink = step.get("sink_share") is not None
        eqs += [
            Equation(KeyMajorTerm.M_INIT, "m_i = sink_h" if sink else "m_i = −∞  (in HBM)", ("m_i = ", m_old), m_old),
            Equation(KeyMajorTerm.L_INIT, "l_i = 1" if sink else "l_i = 0  (in HBM)", ("l_i = ", l_old), l_old),
            Equation(KeyMajorTerm.O_INIT, "O_i = 0  (in HBM)", ("O_i = ", O), O),
        ]
    eqs += [
        Equation(KeyMajorTerm.M_LOAD, "load m_i from HBM", ("m_i = ", m_old), m_old),
        Equation(KeyMajorTerm.L_LOAD, "load l_i from HBM", ("l_i = ", l_old), l_old),
        Equation(KeyMajorTerm.O_LOAD, "load O_i from HBM", ("O_i = ", O), O),
        Equation(KeyMajorTerm.S_IJ, score_symbolic(step), ("S_ij = ", S), S, BIAS if step.biased else None),
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


def key_major_step_json(step: Step) -> dict[str, Any]:
    """As :func:`.equations.step_json`, with FA1 Alg. 1's lines (what a key-major UPDATE carries)."""
    rows = [key_major_row_equations(step, r) for r in range(step.rows[1] - step.rows[0])]
    return {"rowStart": step.rows[0], "rows": [[e.to_json() for e in row] for row in rows]}


KEY_MAJOR_COMPACT = (KeyMajorTerm.SCALE_OLD, KeyMajorTerm.SCALE_TILE, KeyMajorTerm.L_NEW)  # a row in one line
