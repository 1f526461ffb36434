"""A replay as the seed example's manifest: the "experiment" dict, one case per tile update.

The field names and labels are those of the recorded teaching example, character for character (en
dash ``–`` in ranges, middle dot ``·`` as separator); ``replay.schema.json`` next to this file is the
documented JSON Schema. Two choices the seed did not have to make:

- JSON has no infinities, so a causally masked score (``-inf``) and the running maximum of a row that has
  seen no visible key yet (``-inf``) are written as ``null``.
- Tiles skipped by causality and the key-major schedule are not in the seed format. With
  ``extensions=True`` they are added under a top-level ``"replay"`` key and a per-case ``"tiles"`` key,
  which a reader of the seed format ignores; by default the dict holds the seed's keys only.
"""

from __future__ import annotations

import json
import math
from importlib import resources

from torch import Tensor

from .replay import Replay, TileStep

TITLE = "Finish attention without retaining every score."
CONTROL_LABEL = "Tile update"


def span(a: int, b: int) -> str:
    """Half-open ``[a, b)`` as the seed's inclusive label, ``"a–(b-1)"``."""
    return f"{a}–{b - 1}"


def _number(x: float) -> float | None:
    return None if math.isinf(x) and x < 0 else x


def _values(t: Tensor) -> list[float | None]:
    return [_number(float(x)) for x in t.reshape(-1).tolist()]


def _case(replay: Replay, step: TileStep, extensions: bool) -> dict:
    (r0, r1), (c0, c1) = step.rows, step.cols
    case = {
        "id": f"tile-{step.index + 1}",
        "label": f"Query rows {span(r0, r1)} · key columns {span(c0, c1)}",
        "schedule": {
            "rows": replay.N_q,
            "columns": replay.N_k,
            "rowStart": r0,
            "rowCount": r1 - r0,
            "columnStart": c0,
            "columnCount": c1 - c0,
            "completedColumns": step.completed_columns,
        },
        "vectors": [
            {"label": "Current score tile · row-major", "values": _values(step.S_ij)},
            {"label": "Running row maximum", "values": _values(step.m_i)},
            {"label": "Running denominator", "values": _values(step.l_i)},
            {"label": f"Partial output · query {r0}", "values": _values(step.O_partial[0])},
            {"label": f"Final dense output · query {r0}", "values": _values(step.O_final[0])},
        ],
        "metrics": [
            {"label": "Score elements in current tile", "value": (r1 - r0) * (c1 - c0)},
            {"label": "Elements in a full score matrix", "value": replay.N_q * replay.N_k},
            {"label": f"Max difference from final output · rows {span(r0, r1)}", "value": step.max_diff},
        ],
    }
    if extensions:
        case["tiles"] = {
            "i": step.i,
            "j": step.j,
            "kind": step.kind.value,
            "position": step.position + 1,
            "done": [list(t) for t in step.done],
        }
    return case


def to_experiment(replay: Replay, *, extensions: bool = False) -> dict:
    """The seed manifest's ``"experiment"`` dict for ``replay``, one case per tile update."""
    experiment: dict = {
        "kind": "schedule",
        "title": TITLE,
        "controlLabel": CONTROL_LABEL,
        "cases": [_case(replay, step, extensions) for step in replay.steps],
    }
    if extensions:
        experiment["replay"] = {
            "order": replay.order,
            "causal": replay.causal,
            "causalAlign": replay.causal_align,
            "diagonalOffset": replay.diagonal_offset,
            "scale": replay.scale,
            "blockM": replay.block_m,
            "blockN": replay.block_n,
            "queryBlock": replay.query_block,
            "scheduleLength": len(replay.schedule),
            "skipped": [list(t) for t in replay.skipped],
        }
    return experiment


def to_json(replay: Replay, *, extensions: bool = False, indent: int | None = 2) -> str:
    """``to_experiment`` as strict JSON: ``allow_nan=False`` guarantees no ``Infinity``/``NaN`` tokens."""
    return json.dumps(to_experiment(replay, extensions=extensions), indent=indent, ensure_ascii=False, allow_nan=False)


def schema() -> dict:
    """The JSON Schema (draft 2020-12) of :func:`to_experiment`'s output."""
    return json.loads(resources.files(__package__).joinpath("replay.schema.json").read_text(encoding="utf-8"))
