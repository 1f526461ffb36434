"""A backward replay as JSON, and the payload of the page's "Backward" view (the same dict).

One document: the replay's sizes and options, its inputs (``Q, K, V, O, lse, dO, delta``), the SKIP tiles,
then the steps in the order they run, the preprocess first, then every dK/dV step, then every dQ step
(``"stepKind"``: a :class:`~flashattn_teach.replay.steps.StepKind` value), each with its tile's
``S_ij, P_ij, dP_ij, dS_ij``, the accumulators after it and its equations
(``{line, name, symbolic, substituted, value}``), and at the end the gradients, the float64
``torch.autograd`` oracle's and ``max |grad - oracle|`` per gradient. Tensors are nested lists; the JSON is
strict (no NaN or infinity): ``-inf`` is written as ``null``, as in :mod:`.manifest`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import IO, Any

from torch import Tensor

from ..errors import AttentionValueError
from ..masks.causal import TileKind
from .backward_replay import PASSES, BackwardEquation, BackwardReplay, BackwardStep, backward_of
from .replay import Replay

TITLE = "FlashAttention-2 backward replay"
MAX_BACKWARD_TILES = 1024  # T_r x T_c: the document lists every tile of both passes
DEFAULT_MAX_CELLS = 64 * 64  # N_q x N_k up to which the page shows the backward without being asked


def shown_by_default(replay: Replay) -> bool:
    """Whether the page gets a "Backward" tab without ``backward=``: a small replay (``N_q x N_k <=
    DEFAULT_MAX_CELLS`` and at most ``MAX_BACKWARD_TILES`` tiles) made by :func:`.replay.replay`."""
    small = replay.N_q * replay.N_k <= DEFAULT_MAX_CELLS and replay.T_r * replay.T_c <= MAX_BACKWARD_TILES
    return small and replay.call is not None


def _number(x: float) -> float | None:
    if x == float("-inf"):
        return None
    if not math.isfinite(x):
        raise AttentionValueError(f"the backward replay produced {x}, which strict JSON cannot hold")
    return x


def nested(t: Tensor) -> Any:
    """A tensor as nested lists of floats, ``-inf`` as None."""
    if t.dim() == 0:
        return _number(float(t))
    return [nested(x) for x in t]


def _equation(eq: BackwardEquation) -> dict[str, Any]:
    return {
        "line": eq.line,
        "name": eq.name,
        "symbolic": eq.symbolic,
        "substituted": eq.substituted,
        "value": nested(eq.value),
    }


def _step(step: BackwardStep) -> dict[str, Any]:
    return {
        "stepKind": step.step_kind.value,
        "index": step.index,
        "i": step.i,
        "j": step.j,
        "rows": list(step.rows),
        "cols": list(step.cols),
        "kind": step.kind.value,
        "S_ij": nested(step.S_ij),
        "P_ij": nested(step.P_ij),
        "dP_ij": nested(step.dP_ij),
        "dS_ij": nested(step.dS_ij),
        "acc": {name: nested(t) for name, t in step.acc.items()},
        "equations": [_equation(eq) for eq in step.equations],
    }


def to_backward_json(br: BackwardReplay) -> dict[str, Any]:
    """The backward replay ``br`` as a JSON-ready dict (see the module docstring)."""
    preprocess: dict[str, Any] = {"stepKind": PASSES[0].value, "index": 0}
    preprocess["equations"] = [_equation(eq) for eq in br.preprocess()]
    steps = [preprocess, *(_step(s) for s in br.dkdv_steps()), *(_step(s) for s in br.dq_steps())]
    mine, oracle = br.gradients(), br.oracle()
    return {
        "replayKind": "backward",
        "title": TITLE,
        "stepKinds": {p.name: p.value for p in PASSES},
        "tileKinds": {k.name: k.value for k in TileKind},
        "N_q": br.q.shape[0],
        "N_k": br.k.shape[0],
        "blockM": br.block_m,
        "blockN": br.block_n,
        "T_r": len(br.tiling.row_blocks),
        "T_c": len(br.tiling.col_blocks),
        "scale": br.scale,
        "softcap": br.softcap,
        "sink": None if br.sink is None else float(br.sink[0]),
        "batchIndex": br.batch_index,
        "dtype": str(br.q.dtype).removeprefix("torch."),
        "inputs": {
            name: nested(t)
            for name, t in (("Q", br.q), ("K", br.k), ("V", br.v), ("O", br.O), ("lse", br.lse), ("dO", br.dO))
        }
        | {"delta": nested(br.delta)},
        "skipped": [list(tile) for tile in br.skipped()],
        "steps": steps,
        "gradients": {name: nested(t) for name, t in mine.items()},
        "oracle": {name: nested(t) for name, t in oracle.items()},
        "maxError": {name: float((mine[name].double() - oracle[name]).abs().max()) for name in mine},
    }


def write_backward_json(br: BackwardReplay, file: IO[str]) -> None:
    """``to_backward_json(br)`` to ``file``, strict JSON (``allow_nan=False``)."""
    json.dump(to_backward_json(br), file, indent=1, allow_nan=False)


def build_backward_view(replay: Replay, options: Mapping[str, Any]) -> dict[str, Any] | None:
    """The page's "Backward" view: ``options["backward"]`` is a :class:`BackwardReplay`, or True for the
    backward of ``replay``'s own inputs and options (:func:`backward_of`, ``dO`` drawn from its seed), False
    for no tab; absent or None: as True for a small replay (:func:`shown_by_default`), else no tab."""
    backward = options.get("backward")
    if backward is None:
        backward = shown_by_default(replay)
    if backward is False:
        return None
    if backward is True:
        backward = backward_of(replay)
    if not isinstance(backward, BackwardReplay):
        raise AttentionValueError(
            f"render_html(backward=...) takes a BackwardReplay or True, got {type(backward).__name__}"
        )
    return to_backward_json(backward)
