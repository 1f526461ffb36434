"""A decode step that needs a gradient, while it is compiled: torch ops in the graph, one graph for every length.

The decode op (:mod:`flashattn_teach.serving.ops`) is not differentiated, and the eager call reads the cache
lengths into Python ints (a split per range, a slice per batch element), which a graph cannot do without
guarding on every length. So a compiled call that wants a gradient (into ``q``, or into the caches when
nothing is written) computes the same attention from tensors only, the lengths never leaving the graph:

    the write    k_cache[b, :, cache_seqlens[b] + t] = k[b, :, t]      indexed, positions in the graph; into
                 new tensors first, copied into the caches after the attention, so that a refusal (the
                 attention op checks the backend when it runs) leaves them as they were
    the mask     query row i of batch element b sits at p = L_b - N_new + i,  L_b = cache_seqlens[b] + N_new_kv;
                 it sees key j iff j < L_b, and j <= p (causal), p - left <= j <= p + right (window)
    ALiBi        -slope * |p - j| added, as an additive mask (-inf where not visible)
    attention    the attention op (ops/attention.py) over all N_max keys with attn_mask=...: it is
                 differentiated (its backward recomputes the forward), and a row that sees no key gives
                 O = 0, lse = -inf, as the eager call does

    pages        with block_table, the caches are gathered first, every page of every row:
                 k_cache[block_table] (B, max_blocks, H_kv, page_size, D) -> (B, H_kv, N_max, D), the ids
                 checked in the graph (those the step uses) and clamped (those past it, never visible);
                 the write goes through the table, page block_table[b, j // page_size], slot j % page_size
    leftpad      keys j < cache_leftpad[b] are not visible
    sinks        merged once per row after the attention, (O = 0, lse = sink_h), as the eager call does

It reads ``N_max`` keys per row rather than ``L_b``, the price of a graph that does not depend on the
lengths; the eager call and the op read only the valid ones.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from .._options import make_options
from .._validate.inputs import check_bool, check_window
from .._validate.sinks import check_sinks
from ..dispatch import planner, runner
from ..ops.attention import AttentionArgs, traceable
from ..ops.attention import call as attention_op
from .checks import check_cache_inputs, check_decode_alibi, check_no_grad_through_write, check_seqlens_tensor
from .page_checks import check_block_table, check_cache_leftpad, check_page_shapes
from .ranges import merge_sinks
from .step import DecodeCall


def _lengths(
    cache_seqlens: Tensor | int | torch.SymInt, B: int, N_new_kv: int, N_max: int, device: torch.device
) -> Tensor:
    """``cache_seqlens`` as an int64 ``(B,)`` tensor. A tensor's values are checked in the graph: a
    ``RuntimeError`` naming ``cache_seqlens`` when the graph runs (an int was checked while tracing)."""
    if not isinstance(cache_seqlens, Tensor):
        return torch.full((B,), cast(int, cache_seqlens), dtype=torch.int64, device=device)  # (B,): one each
    check_seqlens_tensor(cache_seqlens, B, device)
    lengths = cache_seqlens.long()
    fits = ((lengths >= 0) & (lengths + N_new_kv <= N_max)).all()
    torch._assert_async(fits, "cache_seqlens must lie in [0, N_max - N_new_kv]: the new entries must fit the caches")
    return lengths


def _visible(
    L: Tensor, N_new: int, N_max: int, causal: bool, window: tuple[int, int], leftpad: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``(visible (B, N_new, N_max), distance (B, N_new, N_max))``: which keys each row sees, and ``p - j``."""
    rows = torch.arange(N_new, device=L.device)
    keys = torch.arange(N_max, device=L.device)
    p = (L[:, None] - N_new + rows)[:, :, None]  # (B, N_new, 1): row i's position in its sequence
    distance = p - keys  # (B, N_new, N_max)
    visible = keys < L[:, None, None]  # (B, 1, N_max) broadcast over the rows
    if leftpad is not None:
        visible = visible & (keys >= leftpad.long()[:, None, None])  # the padding slots are no keys
    left, right = window
    right = 0 if causal else right
    if left >= 0:
        visible = visible & (distance <= left)
    if right >= 0:
        visible = visible & (distance >= -right)
    return visible.expand(-1, N_new, -1), distance


def traced_step(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, call: DecodeCall, cache_seqlens: Tensor | int | torch.SymInt
) -> tuple[Tensor, Tensor]:
    """``(O (B, H_q, N_new, D_v), lse (B, H_q, N_new))`` of one decode step, ``call.k, call.v`` written into the
    caches first; ``cache_seqlens`` the call's, an int already checked (the module docs give the rest)."""
    o = call.options
    block_table = o["block_table"]
    q, k_cache, v_cache, k, v = check_cache_inputs(
        q, k_cache, v_cache, call.k, call.v, autocast=call.autocast, paged=block_table is not None
    )
    B, H_q, N_new, _ = q.shape
    table = check_block_table(block_table, B, q.device)
    N_max = check_page_shapes(k_cache, table)[1] if table is not None else k_cache.shape[2]
    N_new_kv = 0 if k is None else k.shape[2]
    if k is not None and v is not None:
        check_no_grad_through_write(k_cache, v_cache, k, v)
    causal, window = check_bool("causal", o["causal"]), check_window(o["window"])
    scale, softcap = o["scale"], o["softcap"]
    slopes = check_decode_alibi(o["alibi_slopes"], B, H_q, q.device)
    leftpad = check_cache_leftpad(o["cache_leftpad"], B, q.device)
    sink_logits = check_sinks(o["sinks"], H_q, q.device)
    lengths = _lengths(cache_seqlens, B, N_new_kv, N_max, q.device)
    if leftpad is not None:
        fits = ((leftpad >= 0) & (leftpad.long() <= lengths)).all()
        torch._assert_async(fits, "cache_leftpad must lie in [0, cache_seqlens]")
    keys, values = k_cache, v_cache
    ids = None
    if table is not None:
        ids = _page_ids(table, lengths + N_new_kv, k_cache.shape[0], k_cache.shape[2])
        # (B, max_blocks, H_kv, page_size, D) -> (B, H_kv, max_blocks, page_size, D) -> (B, H_kv, N_max, D)
        keys, values = (
            pool[ids].transpose(1, 2).reshape(B, pool.shape[1], N_max, pool.shape[3]) for pool in (k_cache, v_cache)
        )
    if k is not None and v is not None:
        pos = lengths[:, None] + torch.arange(N_new_kv, device=q.device)  # (B, N_new_kv)
        batch = torch.arange(B, device=q.device)[:, None]  # (B, 1)
        # (B, N_max, H_kv, D) with (B, N_new_kv, H_kv, D) put at [batch, pos]: new tensors, the caches untouched
        keys, values = (
            cache.transpose(1, 2).index_put((batch, pos), new.transpose(1, 2)).transpose(1, 2)
            for cache, new in ((keys, k), (values, v))
        )
    visible, distance = _visible(lengths + N_new_kv, N_new, N_max, causal, window, leftpad)
    mask: Tensor = visible[:, None]  # (B, 1, N_new, N_max): the same for every head
    if slopes is not None:
        per_head = (slopes if slopes.dim() == 2 else slopes.expand(B, -1)).float()  # (B, H_q)
        bias = -per_head[:, :, None, None] * distance[:, None].abs()  # (B, H_q, N_new, N_max)
        mask = bias.masked_fill(~mask, float("-inf"))
    opts = make_options(q, keys, values, attn_mask=mask, scale=scale, softcap=softcap, enable_gqa=True)
    if traceable(mask, None):  # the attention op, differentiated by its backward op
        args = AttentionArgs.of_call(
            opts, o["backend"], scale_given=scale is not None, alibi_slopes=None, seqlens_k=None
        )
        O, lse = attention_op(q, keys, values, args)
    else:  # slopes that need a gradient: traced through, as flash_attention would
        O, lse = runner.run(planner.plan(q, keys, values, opts, o["backend"]), q, keys, values, opts)
    if sink_logits is not None:
        O, lse = merge_sinks(O, lse, sink_logits)
    if k is not None and v is not None:
        with torch.no_grad():  # the in-place write, after every check and the attention: nothing is left to refuse
            if ids is None:
                k_cache.transpose(1, 2)[batch, pos] = k.transpose(1, 2)
                v_cache.transpose(1, 2)[batch, pos] = v.transpose(1, 2)
            else:  # through the table: (B, N_new_kv) pages and slots, the pools' [page, :, slot] (B, N_new_kv, H_kv, D)
                page, slot = ids.gather(1, pos // k_cache.shape[2]), pos % k_cache.shape[2]
                k_cache[page, :, slot] = k.transpose(1, 2)
                v_cache[page, :, slot] = v.transpose(1, 2)
    return O, lse


def _page_ids(block_table: Tensor, L: Tensor, num_blocks: int, page_size: int) -> Tensor:
    """``block_table`` as int64 ids to gather with: the pages a row uses, ``[0, ceil(L_b / page_size))``,
    checked in the graph to lie in ``[0, num_blocks)``; the entries past them, which may hold anything and
    gather keys no row sees, clamped into the pool."""
    ids = block_table.long()  # (B, max_blocks)
    used = torch.arange(ids.shape[1], device=ids.device)[None, :] < (L[:, None] + page_size - 1) // page_size
    bad = used & ((ids < 0) | (ids >= num_blocks))  # (B, max_blocks)
    torch._assert_async(~bad.any(), "block_table: the ids of the pages a step uses must lie in [0, num_blocks)")
    return ids.clamp(0, max(num_blocks - 1, 0))
