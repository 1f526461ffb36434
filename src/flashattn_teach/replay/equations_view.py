"""The equations a replay shows, in either order: the lines the table and the picture print for an UPDATE step
(:func:`replay_equations`) and the page's equations panel payload (:func:`build_view`). A query-major step's lines
are FA2 Alg. 1's (:mod:`.equations`), a key-major step's FA1 Alg. 1's (:mod:`.equations_key_major`); each step
carries its own (``step.equations``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .equations import SOURCE, ShownEquations, shown_equations
from .equations_key_major import KEY_MAJOR_COMPACT, KEY_MAJOR_SOURCE, key_major_step_json
from .replay import Replay
from .step import Step

__all__ = ["build_view", "replay_equations"]


def replay_equations(replay: Replay, step: Step) -> ShownEquations:
    """The lines the table and the PNG show for ``step`` of ``replay``: FA1 Alg. 1's for key-major order (its
    ``V_j`` is ``replay.steps.v``'s tile), FA2 Alg. 1's otherwise."""
    if replay.order != "key_major":
        return shown_equations(step)
    rows = tuple(step.equations)  # a key-major UPDATE carries FA1's lines
    return ShownEquations("FA1 Alg. 1", KEY_MAJOR_SOURCE, step.rows[0], rows, KEY_MAJOR_COMPACT)


def build_view(replay: Replay, options: Mapping[str, Any]) -> dict[str, Any] | None:
    """The equations panel's payload; None without updates. Query-major: the numbers are in each case's
    ``"equations"``. Key-major: ``"steps"`` lists, per update, FA1 Alg. 1's lines (:func:`key_major_step_json`),
    which the panel shows instead, and ``"note"`` says how they relate to the case's FA2 lines."""
    if len(replay.steps) == 0:
        return None
    r0, r1 = replay.rows
    if replay.order != "key_major":
        return {"source": SOURCE, "rowStart": r0, "rowCount": r1 - r0}
    return {
        "source": KEY_MAJOR_SOURCE,
        "rowStart": r0,
        "rowCount": r1 - r0,
        "note": "key-major order: the state goes to HBM between tiles. The replay reads it back as acc = O_i · l_i "
        "and updates it in FA2's form (the JSON's equations); FA1's form below gives the same m_i, l_i and O_i.",
        "steps": [key_major_step_json(s) for s in replay.steps],
    }
