"""A replay as the seed example's manifest: the "experiment" dict, one case per tile update.

The field names and labels are those of the recorded teaching example, character for character (en
dash ``–`` in ranges, middle dot ``·`` as separator); ``replay.schema.json`` next to this file is the
documented JSON Schema. Two choices the seed did not have to make:

- JSON has no infinities, so a masked score (``-inf``) and the running maximum of a row that has
  seen no visible key yet (``-inf``) are written as ``null``.
- Skipped (SKIP) tiles, each update's tile kind and the key-major schedule are not in the seed format. With
  ``extensions=True`` they are added under a top-level ``"replay"`` key and a per-case ``"tiles"`` key,
  which a reader of the seed format ignores; by default the dict holds the seed's keys only. The extensions
  also give each case its ``"equations"`` (:mod:`.equations`): per replayed row, FA2 Alg. 1's lines with this
  update's numbers.
- An attention sink is not in the seed format either; a replay with one adds, whatever ``extensions``, a
  top-level ``"sink"`` (``sink_h`` and each row's final share ``exp(sink_h - lse_i)``) and per case
  ``"sinkShare"``, the sink's share of each row so far. Without a sink neither key is written.

A decode step (:func:`decode_to_experiment`) is the same format, its cases every split's tile updates in order
(key columns in cache positions), each with its ``"split"``; ``"decode"`` holds the key roles, a paged cache's
pages, the sink, the ranges, each split's ``(O_s, lse_s)`` and each merge. A backward replay
(:func:`to_backward_json`, also the page's "Backward" view) is a document of its own: sizes, options, inputs
(``Q, K, V, O, lse, dO, delta``), SKIP tiles, the steps in the order they run with their tiles' ``S, P, dP, dS``,
accumulators and equations, then the gradients beside the float64 ``torch.autograd`` oracle's. Every document
names its scenario (``"replayKind"``) and every case or step its kind (``"stepKind"``, a :class:`~.steps.StepKind`);
:func:`write_json` writes any of the three, a forward replay one case at a time (in the memory of one case).
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator, Mapping
from importlib import resources
from typing import IO, Any

from torch import Tensor

from ..errors import AttentionValueError
from ..masks.causal import TileKind
from .backward_replay import PASSES, BackwardReplay, backward_of
from .decode_replay import DecodeReplay, SplitReplay
from .equations import step_json
from .kernel_view import kernel_case, kernel_head
from .kernel_view_backward import kernel_case as backward_kernel_case
from .kernel_view_backward import kernel_head as backward_kernel_head
from .kernel_view_decode import decode_kernel_head
from .replay import Replay
from .step import Step, StepEquation, StepKind

TITLE = "Finish attention without retaining every score."
CONTROL_LABEL = "Tile update"
MAX_EXTENSION_TILES = 10_000_000


def span(a: int, b: int) -> str:
    """Half-open ``[a, b)`` as the seed's inclusive label, ``"a–(b-1)"``."""
    return f"{a}–{b - 1}"


def json_number(x: float) -> float | None:
    """``x`` for JSON, which has no infinities: ``-inf`` (a row that has seen no key yet) is written as null."""
    return None if x == -math.inf else x


def json_values(t: Tensor) -> list[float | None]:
    """Any tensor's values, flattened, for JSON (:func:`json_number`)."""
    return [json_number(float(x)) for x in t.reshape(-1).tolist()]


def json_rows(t: Tensor) -> list[list[float | None]]:
    """``(r, c)`` -> ``r`` lists of ``c`` values for JSON (:func:`json_number`)."""
    return [json_values(row) for row in t]


def tile_case(step: Step, number: int, shape: tuple[int, int], full_cells: int) -> dict[str, Any]:
    """Case ``tile-number`` of the experiment: tile update ``step`` in the ``(rows, columns)`` score matrix of
    ``shape`` (the replay's own ``(N_q, N_k)``, or a decode's), its vectors and metrics; ``full_cells``: the
    size of the full score matrix a dense path would hold."""
    (r0, r1), (c0, c1) = step.rows, step.cols
    return {
        "id": f"tile-{number}",
        "stepKind": step.step_kind.value,
        "label": f"Query rows {span(r0, r1)} · key columns {span(c0, c1)}",
        "schedule": {
            "rows": shape[0],
            "columns": shape[1],
            "rowStart": r0,
            "rowCount": r1 - r0,
            "columnStart": c0,
            "columnCount": c1 - c0,
            "completedColumns": step.completed_columns,
        },
        "vectors": [
            {"label": "Current score tile · row-major", "values": json_values(step["S_ij"])},
            {"label": "Running row maximum", "values": json_values(step["m_i"])},
            {"label": "Running denominator", "values": json_values(step["l_i"])},
            {"label": f"Partial output · query {r0}", "values": json_values(step["O_partial"][0])},
            {"label": f"Final dense output · query {r0}", "values": json_values(step["O_final"][0])},
        ],
        "metrics": [
            {"label": "Score elements in current tile", "value": (r1 - r0) * (c1 - c0)},
            {"label": "Elements in a full score matrix", "value": full_cells},
            {"label": f"Max difference from final output · rows {span(r0, r1)}", "value": step.max_diff},
        ],
    }


def _case(replay: Replay, step: Step, extensions: bool) -> dict[str, Any]:
    case = tile_case(step, step.index + 1, (replay.N_q, replay.N_k), replay.N_q * replay.N_k)
    share = step.get("sink_share")
    if share is not None:
        case["sinkShare"] = json_values(share)
    if step.kernel:  # source="triton": the kernel's numbers beside the reference's (.kernel_view)
        case["kernel"] = kernel_case(step)
    if extensions:
        case["tiles"] = {
            "i": step.i,
            "j": step.j,
            "kind": step.tile_kind.value,
            "position": step.position + 1,
            "done": [list(t) for t in step.done],
        }
        case["equations"] = step_json(step)
    return case


def extension_tiles(replay: Replay) -> int:
    """A bound on the tiles the extensions list: the skipped ones once, the done ones at every update."""
    return (len(replay.steps) + 1) * replay.T_r * replay.T_c


def _cases(replay: Replay, extensions: bool) -> Iterator[dict[str, Any]]:
    return (_case(replay, step, extensions) for step in replay.steps)


def _head(replay: Replay, extensions: bool) -> dict[str, Any]:
    """Every key of the experiment, in order, with ``"cases"`` empty."""
    experiment: dict[str, Any] = {
        "kind": "schedule",
        "replayKind": replay.replay_kind,
        "title": TITLE,
        "controlLabel": CONTROL_LABEL,
        "cases": [],
    }
    if extensions:
        tiles = extension_tiles(replay)
        if tiles > MAX_EXTENSION_TILES:
            raise AttentionValueError(
                f"extensions=True would list up to {tiles} tiles (every tile done, at each of {len(replay.steps)} "
                f"updates, of a {replay.T_r} x {replay.T_c} grid), more than {MAX_EXTENSION_TILES}: use larger "
                "blocks or leave the extensions out"
            )
        experiment["replay"] = {
            "order": replay.order,
            "causal": replay.causal,
            "causalAlign": replay.causal_align,
            "diagonalOffset": replay.diagonal_offset,
            "window": list(replay.window),
            "variants": list(replay.variants),
            "labels": replay.labels(),  # the heading's labels, as the table's and the PNG's
            "scale": replay.scale,
            "blockM": replay.block_m,
            "blockN": replay.block_n,
            "queryBlock": replay.query_block,
            "scheduleLength": len(replay.schedule),
            "skipped": [list(t) for t in replay.skipped],
        }
    if replay.source == "triton":
        experiment["kernel"] = kernel_head(replay)
    share = replay.sink_share()
    if share is not None:
        experiment["sink"] = {"value": replay.sink, "rowStart": replay.rows[0], "share": json_values(share)}
    return experiment


def to_experiment(replay: Replay, *, extensions: bool = False) -> dict[str, Any]:
    """The seed manifest's ``"experiment"`` dict for ``replay``, one case per tile update."""
    experiment = _head(replay, extensions)
    experiment["cases"] = list(_cases(replay, extensions))
    return experiment


def _dumps(obj: object, indent: int | None) -> str:
    # allow_nan=False: a stray inf or NaN raises here rather than writing the non-JSON token Infinity or NaN.
    return json.dumps(obj, indent=indent, ensure_ascii=False, allow_nan=False)


def write_json(
    replay: Replay | BackwardReplay | DecodeReplay, file: IO[str], *, extensions: bool = False, indent: int | None = 2
) -> None:
    """Write any replay to ``file`` as strict JSON: a decode step as :func:`decode_to_experiment`, a backward one
    as :func:`to_backward_json` (``indent`` 1), a forward one as ``to_experiment(replay, extensions=...)`` one
    case at a time, ``json.dumps``'s text character for character: the experiment is dumped with no cases, each
    case alone and indented to its depth (a JSON string holds no raw newline: indenting moves only the layout)."""
    if isinstance(replay, DecodeReplay):
        file.write(_dumps(decode_to_experiment(replay), indent))
        return
    if isinstance(replay, BackwardReplay):
        write_backward_json(replay, file)
        return
    head, tail = _dumps(_head(replay, extensions), indent).split('"cases": []', 1)
    file.write(head + '"cases": [')
    if indent is None:
        between, first, last, pad = ", ", "", "", ""
    else:
        pad = " " * (2 * indent)  # a case sits at depth 2: experiment -> "cases" list -> case
        between, first, last = ",\n" + pad, "\n" + pad, "\n" + " " * indent
    written = False
    for case in _cases(replay, extensions):
        file.write((between if written else first) + _dumps(case, indent).replace("\n", "\n" + pad))
        written = True
    file.write((last if written else "") + "]" + tail)


def to_json(replay: Replay | BackwardReplay | DecodeReplay, *, extensions: bool = False, indent: int | None = 2) -> str:
    """Any replay as strict JSON (``-inf`` written as ``null``); see :func:`write_json`."""
    buffer = io.StringIO()
    write_json(replay, buffer, extensions=extensions, indent=indent)
    return buffer.getvalue()


def schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of every replay's JSON, forward, backward and decode."""
    return json.loads(resources.files(__package__).joinpath("replay.schema.json").read_text(encoding="utf-8"))


def _decode_case(r: DecodeReplay, split: SplitReplay, step: Step, number: int) -> dict[str, Any]:
    return {
        **tile_case(step, number, (r.N_new, r.N_max), r.N_new * r.L),
        "split": {
            "index": split.index,
            "keys": list(split.keys),
            "update": step.index + 1,
            "kind": step.tile_kind.value,
        },
    } | ({"kernel": kernel_case(step)} if step.kernel else {})  # source="triton" (.kernel_view_decode)


def _decode_cases(r: DecodeReplay) -> Iterator[dict[str, Any]]:
    number = 0
    for split in r.splits:
        for step in split:
            number += 1
            yield _decode_case(r, split, step, number)


def _decode(r: DecodeReplay) -> dict[str, Any]:
    decode = _decode_keys(r)
    if r.page_size is not None:  # paged: the element's pages in key order; key j lives on pages[j // pageSize]
        decode["pageSize"] = r.page_size
        decode["pages"] = list(r.pages)
    if r.sink is not None:  # the last merge is the sink's: "split" null, its weightB the sink's share per row
        decode["sink"] = r.sink
    return decode


def _decode_keys(r: DecodeReplay) -> dict[str, Any]:
    return {
        "cacheLen": r.cache_len,
        "newKeys": r.N_new_kv,
        "newQueries": r.N_new,
        "cacheSize": r.N_max,
        "blockN": r.block_n,
        "numSplits": r.num_splits,
        "keys": list(r.keys),
        "causal": r.causal,
        "window": list(r.window),
        "softcap": r.softcap,
        "alibiSlope": r.alibi_slope,
        "scale": r.scale,
        "batchIndex": r.batch_index,
        "head": r.head,
        "keyRoles": [r.role(j).value for j in range(r.N_max)],
        "visible": ["".join("1" if x else "0" for x in row) for row in r.visible.tolist()],
        "ranges": [list(keys) for keys in r.ranges],
        "splits": [
            {
                "split": s.index,
                "keys": list(s.keys),
                "tileUpdates": len(s),
                "lse": json_values(s.lse_s),
                "output": json_rows(s.O_s),
            }
            for s in r.splits
        ],
        "merges": [merge_json(m) for m in r.merges],
        "output": json_rows(r.O),
        "lse": json_values(r.lse),
        "denseOutput": json_rows(r.O_final),
        "denseLse": json_values(r.lse_final),
        "maxDiff": r.max_diff,
    }


def merge_json(m: Step) -> dict[str, Any]:
    """One merge of the decode step: the partials it combined, their weights and the result, per row."""
    return {
        "stepKind": m.step_kind.value,
        "merge": m.index + 1,
        "merged": list(m.merged),
        "split": m.split,
        "lseA": json_values(m["lse_a"]),
        "lseB": json_values(m["lse_b"]),
        "lse": json_values(m["lse"]),
        "weightA": json_values(m["w_a"]),
        "weightB": json_values(m["w_b"]),
        "output": json_rows(m["O"]),
        "maxDiff": m.max_diff,
    } | ({"kernel": kernel_case(m)} if m.kernel else {})


def decode_to_experiment(r: DecodeReplay) -> dict[str, Any]:
    """The seed manifest's ``"experiment"`` dict for a decode step: one case per tile update, then ``"decode"``."""
    return {
        "kind": "schedule",
        "replayKind": r.replay_kind,
        "title": TITLE,
        "controlLabel": CONTROL_LABEL,
        "cases": list(_decode_cases(r)),
        "decode": _decode(r),
    } | ({"kernel": decode_kernel_head(r)} if r.source == "triton" else {})


def write_decode_json(r: DecodeReplay, file: IO[str], *, indent: int | None = 2) -> None:
    """Write ``decode_to_experiment(r)`` to ``file`` (the old name of :func:`write_json` for a decode step)."""
    write_json(r, file, indent=indent)


# The backward replay's document.

BACKWARD_TITLE = "FlashAttention-2 backward replay"
MAX_BACKWARD_TILES = 1024  # T_r x T_c: the document lists every tile of both passes
DEFAULT_MAX_CELLS = 64 * 64  # N_q x N_k up to which the page shows the backward without being asked


def shown_by_default(replay: Replay) -> bool:
    """Whether the page gets a "Backward" tab without ``backward=``: a small replay (``N_q x N_k <=
    DEFAULT_MAX_CELLS`` and at most ``MAX_BACKWARD_TILES`` tiles) made by :func:`.replay.replay`."""
    small = replay.N_q * replay.N_k <= DEFAULT_MAX_CELLS and replay.T_r * replay.T_c <= MAX_BACKWARD_TILES
    return small and replay.call is not None


def nested(t: Tensor) -> Any:
    """A tensor as nested lists of floats, ``-inf`` as None (:func:`json_number`; a NaN or +inf: strict JSON
    refuses it when written)."""
    return json_number(float(t)) if t.dim() == 0 else [nested(x) for x in t]


def _equation(eq: StepEquation) -> dict[str, Any]:
    text = {"line": eq.line, "name": eq.name, "symbolic": eq.symbolic, "substituted": eq.substituted}
    return text | {"value": nested(eq.value)}


def _step(step: Step) -> dict[str, Any]:
    """A backward step as JSON: the PREPROCESS its kind, index and equations; a pass's step its tile and terms too."""
    out: dict[str, Any] = {"stepKind": step.step_kind.value, "index": step.index}
    if step.step_kind is not StepKind.PREPROCESS:
        out |= {"i": step.i, "j": step.j, "rows": list(step.rows), "cols": list(step.cols)}
        out["kind"] = step.tile_kind.value
        out |= {name: nested(step[name]) for name in ("S_ij", "P_ij", "dP_ij", "dS_ij")}
        out["acc"] = {name: nested(t) for name, t in step.accumulators.items()}
    return out | {"equations": [_equation(eq) for eq in step.equations]}


def to_backward_json(br: BackwardReplay) -> dict[str, Any]:
    """The backward replay ``br`` as a JSON-ready dict (see the module docstring)."""
    steps = [_step(s) | ({"kernel": backward_kernel_case(br, s)} if s.kernel else {}) for s in br.all_steps()]
    mine, oracle = br.gradients(), br.oracle()
    return {
        "replayKind": br.replay_kind,
        "title": BACKWARD_TITLE,
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
    } | ({"kernel": backward_kernel_head(br)} if br.source == "triton" else {})


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
