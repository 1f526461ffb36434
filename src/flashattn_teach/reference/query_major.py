"""Changes from core/loops.py (``query_major_attention``): the grouped layout (GQA heads share ``K, V``);
the tiles and their masks come from the mask contract (``masks.spec.Tiling``: windows, ``seqlens_k``, masks,
block masks, so SKIP tiles are never visited), scores get softcap, bias and ``score_mod``
(``reference/scores.py``), weights get dropout, and rows may start from an attention sink.

Query-major online-softmax attention: the teaching example's algorithm, and FlashAttention-2's order.

For each query block ``i`` (rows ``[r0, r1)``) the running state ``(m_i, l_i, acc)`` lives "on chip" while
the loop streams key/value blocks ``j`` past it; ``O_i`` and ``lse_i`` are written once, at the end
(Dao 2023, FlashAttention-2, Alg. 1). At most ``block_m x block_n`` scores per (batch, head) exist at any
moment. The mask contract (:mod:`flashattn_teach.masks`) decides the key blocks each query block visits: tiles that no
row can see (above the causal diagonal, outside a window, past every ``seqlens_k``, all hidden by an
``attn_mask``) are never visited, so a window of width ``w`` visits ``O(N_q (w + Bc))`` scores; FULL tiles
run without a mask, PARTIAL ones with the tile's own. Dropout drops each tile's weights by their places in
the whole score matrix (``tile_dropout.py``), after ``l_i`` has summed them.

The blocks are collected and concatenated rather than written into a preallocated output, so the loop is
a pure function of its inputs and ``torch.func.vmap`` can run it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.online_softmax import finalize, init_state, update
from ..dropout import DropoutKey
from ..masks.spec import Tiling
from .scores import score_tile
from .tile_dropout import NO_DROPOUT, grouped_heads, tile_dropout


def query_major_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    tiling: Tiling,
    dropout: DropoutKey = NO_DROPOUT,
    sink: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Grouped layout in, grouped layout out: ``q (B, H_kv, G, N_q, D)``, ``k (B, H_kv, 1, N_k, D)``,
    ``v (B, H_kv, 1, N_k, D_v)`` -> ``O (B, H_kv, G, N_q, D_v)``, ``lse (B, H_kv, G, N_q)``; ``dropout`` is
    the call's key (none by default); ``sink (H_kv, G, 1)`` the attention sinks of the query heads, each
    row's first "key" (``online_softmax.init_state``)."""
    lead = q.shape[:-2]
    D_v = v.shape[-1]
    N_q, N_k = q.shape[-2], k.shape[-2]
    softcap = tiling.spec.softcap
    bh = grouped_heads(q)  # (B, H_kv, G, 1, 1): b * H_q + h, the dropout's head index
    O_blocks, lse_blocks = [q.new_empty((*lead, 0, D_v))], [q.new_empty((*lead, 0))]
    for i, (r0, r1) in enumerate(tiling.row_blocks):  # query block i
        q_i = q[..., r0:r1, :]  # (B, H_kv, G, Br, D)
        m_i, l_i, acc = init_state((*lead, r1 - r0), D_v, dtype=q.dtype, device=q.device, sink=sink)
        for j in tiling.key_blocks(i):  # key block j, SKIP tiles left out
            c0, c1 = tiling.col_blocks[j]
            allowed, bias = tiling.tile(i, j, q.device)  # None, None for a FULL tile without bias
            mod = tiling.score_mod(i, j, q.device)  # the user's score_mod at this tile's indices, or None
            S_ij = score_tile(q_i, k[..., c0:c1, :], scale, allowed, softcap=softcap, bias=bias, score_mod=mod)
            drop = tile_dropout(dropout, bh, (r0, r1), (c0, c1), N_q, N_k, q.device)
            m_i, l_i, acc = update(m_i, l_i, acc, S_ij, v[..., c0:c1, :], drop)
        O_i, lse_i = finalize(m_i, l_i, acc)
        O_blocks.append(O_i)
        lse_blocks.append(lse_i)
    return torch.cat(O_blocks, dim=-2), torch.cat(lse_blocks, dim=-1)
