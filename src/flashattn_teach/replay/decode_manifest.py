"""A decode-step replay as the seed manifest's "experiment" dict, with the splits and merges under ``"decode"``.

The cases are the tile updates of every split in order, each in the seed format of :mod:`.manifest` (key
columns in global cache positions; the partial output is the split's ``acc / l_i``; the final output is the
dense float64 output of the whole step), plus a ``"split"`` key naming its split. The top-level ``"decode"``
key holds what the seed format has no place for: the cache's key roles (old, new, unused), the pages of a
paged cache (``pageSize``, ``pages``), an attention sink (``sink``; its merge, the last, has ``"split":
null``), the ranges, each split's partial ``(O_s, lse_s)``, and each merge's ``lse_a, lse_b, lse``, weights
and error. A reader of the seed format ignores both keys; ``replay.schema.json`` documents them. ``-inf`` is
written as ``null``, as in :mod:`.manifest`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import IO, Any

from .decode_merges import MergeStep
from .decode_replay import DecodeReplay, SplitReplay
from .manifest import CONTROL_LABEL, TITLE, json_rows, json_values, tile_case
from .steps import TileStep


def _case(r: DecodeReplay, split: SplitReplay, step: TileStep, number: int) -> dict[str, Any]:
    return {
        **tile_case(step, number, (r.N_new, r.N_max), r.N_new * r.L),
        "split": {"index": split.index, "keys": list(split.keys), "update": step.index + 1, "kind": step.kind.value},
    }


def _cases(r: DecodeReplay) -> Iterator[dict[str, Any]]:
    number = 0
    for split in r.splits:
        for step in split:
            number += 1
            yield _case(r, split, step, number)


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


def merge_json(m: MergeStep) -> dict[str, Any]:
    """One merge of the decode step: the partials it combined, their weights and the result, per row."""
    return {
        "merge": m.index + 1,
        "merged": list(m.merged),
        "split": m.split,
        "lseA": json_values(m.lse_a),
        "lseB": json_values(m.lse_b),
        "lse": json_values(m.lse),
        "weightA": json_values(m.w_a),
        "weightB": json_values(m.w_b),
        "output": json_rows(m.O),
        "maxDiff": m.max_diff,
    }


def decode_to_experiment(r: DecodeReplay) -> dict[str, Any]:
    """The seed manifest's ``"experiment"`` dict for a decode step: one case per tile update, then ``"decode"``."""
    return {
        "kind": "schedule",
        "title": TITLE,
        "controlLabel": CONTROL_LABEL,
        "cases": list(_cases(r)),
        "decode": _decode(r),
    }


def write_decode_json(r: DecodeReplay, file: IO[str], *, indent: int | None = 2) -> None:
    """Write ``decode_to_experiment(r)`` to ``file`` as strict JSON (a decode step is small: no streaming)."""
    # allow_nan=False: a stray inf or NaN raises here rather than writing the non-JSON Infinity or NaN.
    file.write(json.dumps(decode_to_experiment(r), indent=indent, ensure_ascii=False, allow_nan=False))
