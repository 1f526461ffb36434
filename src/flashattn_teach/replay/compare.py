"""Side by side: the query-major order, the key-major order and dense attention on the same inputs.

Both loop orders compute the same tiles, each exactly once (:mod:`.schedule`):

    query_major   FA2 Alg. 1: for i, for j   a query block's rows are final before the next block starts
    key_major     FA1 Alg. 1: for j, for i   every row is partial until the last key block

so their schedules have the same length ``L``, and "step ``t``" of the comparison is schedule position ``t`` of
each: the same amount of work done. At every step the view shows, per order, the tile grid and the running
``m_i``, ``l_i`` and partial output ``acc / l_i`` of every query row (the rows of the block just updated
marked); the target, fixed, is dense attention over all keys at once:

    m = rowmax(S),   l = rowsum(exp(S - m)),   O = exp(S - m) V / l,   lse = m + log l

(with an attention sink ``sink_h``: ``m = max(sink_h, rowmax(S))`` and ``l`` gains ``exp(sink_h - m)``, the state
the online softmax starts from). The numbers are the replays' own: every query block of
``replay.with_options(order=..., query_block=i)``; the dense ``O`` is each replay's ``O_final``
(:func:`flashattn_teach.reference.dense.dense_attention` of its rows), ``m`` and ``l`` come from the
``(N_q, N_k)`` scores of :func:`flashattn_teach.reference.scores.score_tile` under the call's mask contract.

The payload holds every tile update of both orders (``2 L`` updates of ``BLOCK_M`` rows, ``D_v + 2`` numbers a
row), so the view is built by default only for small replays, ``N_q x N_k <= DEFAULT_MAX_CELLS``;
``render_html(replay, compare=True)`` builds it for any replay the page can draw, ``compare=False`` never.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from ..errors import AttentionTypeError
from ..reference.scores import score_tile
from .inputs import rows_tensors
from .manifest import json_rows, json_values
from .replay import Replay, rows_score_mod
from .schedule import ORDERS, blocks

__all__ = ["DEFAULT_MAX_CELLS", "ORDER_TITLES", "build", "compare_payload"]

# 64 x 64 scores: at most 2 * 32 * 32 updates of 2 rows (2 x 2 tiles), a few hundred kB of JSON for D_v = 64.
DEFAULT_MAX_CELLS = 64 * 64
ORDER_TITLES = {
    "query_major": "Query-major (FlashAttention-2, Alg. 1)",
    "key_major": "Key-major (FlashAttention, Alg. 1)",
}


def _order_updates(replay: Replay, order: str) -> dict[str, Any]:
    """Every tile update of ``order``, of every query block, in schedule order (position ``t`` at index ``t``)."""
    updates: list[dict[str, Any]] = []
    for i in range(blocks(replay.N_q, replay.block_m)):
        for step in replay.with_options(order=order, query_block=i).steps:
            updates.append(
                {
                    "position": step.position,
                    "i": step.i,
                    "j": step.j,
                    "rows": list(step.rows),
                    "m": json_values(step["m_i"]),  # (Br,) after the update
                    "l": json_values(step["l_i"]),  # (Br,)
                    "O": json_rows(step["O_partial"]),  # (Br, D_v): acc / l_i over the keys seen so far
                }
            )
    updates.sort(key=lambda u: u["position"])
    return {"order": order, "title": ORDER_TITLES[order], "updates": updates}


def _bound(replay: Replay) -> Callable[[Tensor], Tensor] | None:
    """The call's ``score_mod`` on the whole ``(N_q, N_k)`` score matrix of the replayed batch element and head."""
    mod = rows_score_mod(replay.mask.mods, replay.batch_index, 0)
    if mod is None:
        return None
    zero = torch.zeros((), dtype=torch.long)
    q_idx = torch.arange(replay.N_q).unsqueeze(-1)  # (N_q, 1)
    kv_idx = torch.arange(replay.N_k).unsqueeze(0)  # (1, N_k)
    return lambda S: mod(S, zero, zero, q_idx.to(S.device), kv_idx.to(S.device))


def _dense(replay: Replay) -> dict[str, Any]:
    """The fixed target: dense attention's ``m``, ``l``, ``lse`` and ``O`` for every query row."""
    by_block = [replay.with_options(query_block=i) for i in range(blocks(replay.N_q, replay.block_m))]
    q = torch.cat([r.steps.q_i for r in by_block])  # (N_q, D), the replayed batch element, compute dtype
    k = replay.steps.k  # (N_k, D)
    N_q, N_k = replay.N_q, replay.N_k
    # Every mask of the contract (the block mask's mask_mod too), as the replay's own dense oracle reads them.
    allowed, bias = rows_tensors(replay.mask, (0, N_q), N_k, q.device, b=replay.batch_index)  # (N_q, N_k) or None
    S = score_tile(q, k, replay.scale, allowed, softcap=replay.mask.softcap, bias=bias, score_mod=_bound(replay))
    m = S.amax(dim=-1)  # (N_q,)
    if replay.steps.sink is not None:
        m = torch.maximum(m, replay.steps.sink)
    # A row that sees no key (m = -inf, and no sink) has l = 0: exp(S - 0) of its -inf scores.
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    l = torch.exp(S - m_safe.unsqueeze(-1)).sum(dim=-1)  # (N_q,)
    if replay.steps.sink is not None:
        l = l + torch.exp(replay.steps.sink - m_safe)
    lse = torch.where(l > 0, m_safe + torch.log(l), torch.full_like(l, -math.inf))
    O = torch.cat([r.steps.O_final for r in by_block])  # (N_q, D_v)
    return {"m": json_values(m), "l": json_values(l), "lse": json_values(lse), "O": json_rows(O)}


def compare_payload(replay: Replay) -> dict[str, Any]:
    """The side-by-side view's data: both orders' updates of every query block and the dense target.

    ``orders[o]["updates"][t]`` is order ``o``'s update at schedule position ``t`` (query block ``i``, key block
    ``j``, its rows' ``m``, ``l`` and ``O`` after it); ``initial`` is every row's state before any update."""
    sink = replay.sink
    return {
        "N_q": replay.N_q,
        "N_k": replay.N_k,
        "blockM": replay.block_m,
        "blockN": replay.block_n,
        "T_r": replay.T_r,
        "T_c": replay.T_c,
        "length": len(replay.schedule),
        "replayedBlock": replay.query_block,
        "initial": {"m": sink, "l": 0.0 if sink is None else 1.0},  # init_state: m = -inf (null), l = 0
        "skipped": [list(tile) for tile in replay.skipped],
        "orders": [_order_updates(replay, order) for order in ORDERS],
        "dense": _dense(replay),
    }


def build(replay: Replay, options: Mapping[str, Any]) -> dict[str, Any] | None:
    """The view's builder (:mod:`.page_views`): ``compare`` None (default: only when ``N_q x N_k <=
    DEFAULT_MAX_CELLS``), True (always) or False (never)."""
    compare = options.get("compare")
    if compare is not None and not isinstance(compare, bool):
        raise AttentionTypeError(f"compare must be True, False or None, got {compare!r}")
    if compare is False or (compare is None and replay.N_q * replay.N_k > DEFAULT_MAX_CELLS):
        return None
    if replay.call is None:  # a Replay not made by replay() cannot be replayed in the other order
        return None
    return compare_payload(replay)
