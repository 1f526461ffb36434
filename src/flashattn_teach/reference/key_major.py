"""Changes from core/loops.py (``key_major_attention``): as ``query_major.py`` adds to the query-major loop,
the grouped layout, the mask contract's tiles, the score features, dropout and sinks, in FA1's loop order.

Key-major online-softmax attention: the loop order of FlashAttention's Algorithm 1 (Dao et al. 2022).

The outer loop runs over key/value blocks ``j``: ``K_j, V_j`` are loaded once. The inner loop runs over
query blocks ``i``, and because the running statistics of block ``i`` are needed again on the next ``j``,
they live in "HBM": ``O_i, l_i, m_i`` are read, updated and written back on every tile (Alg. 1 lines 8
and 12-13). That round trip is what FlashAttention-2 removed by swapping the loops (query-major, see
``query_major.py``): there the state stays on chip and ``O_i`` is written once.

As in Alg. 1 the stored ``O_i`` is normalised after each update, ``O_i = acc / l_i``; reading it back
multiplies by ``l_i`` to recover the unnormalised ``acc`` that the shared update works on. "HBM" is a list
with one entry per query block, replaced on every write-back, so the loop stays a pure function of its
inputs (``torch.func.vmap`` can run it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.online_softmax import init_state, log_sum_exp, normalize, update
from ..dropout import DropoutKey
from ..masks.spec import Tiling
from .scores import score_tile
from .tile_dropout import NO_DROPOUT, grouped_heads, tile_dropout


def key_major_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    tiling: Tiling,
    dropout: DropoutKey = NO_DROPOUT,
    sink: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Same contract as :func:`query_major_forward` (grouped layout; ``sink (H_kv, G, 1)``), same results
    (the same dropout mask too: it is drawn by each weight's place, not by the loop order), other loop
    order."""
    lead = q.shape[:-2]
    D_v = v.shape[-1]
    N_q, N_k = q.shape[-2], k.shape[-2]
    softcap = tiling.spec.softcap
    bh = grouped_heads(q)  # (B, H_kv, G, 1, 1): b * H_q + h, the dropout's head index
    row_blocks = tiling.row_blocks
    # The "HBM" copies of each query block's running state (Alg. 1 line 2): (m_i, l_i, O_i).
    hbm = [init_state((*lead, r1 - r0), D_v, dtype=q.dtype, device=q.device, sink=sink) for r0, r1 in row_blocks]
    for j, (c0, c1) in enumerate(tiling.col_blocks):  # key block j
        k_j, v_j = k[..., c0:c1, :], v[..., c0:c1, :]  # (B, H_kv, 1, Bc, D), (B, H_kv, 1, Bc, D_v)
        for i in tiling.query_blocks(j):  # query block i; rows that see none of this block are left out
            r0, r1 = row_blocks[i]
            m_i, l_i, O_i = hbm[i]  # read from HBM (Alg. 1 line 8)
            acc = O_i * l_i.unsqueeze(-1)  # undo the stored normalisation
            allowed, bias = tiling.tile(i, j, q.device)
            mod = tiling.score_mod(i, j, q.device)  # the user's score_mod at this tile's indices, or None
            S_ij = score_tile(q[..., r0:r1, :], k_j, scale, allowed, softcap=softcap, bias=bias, score_mod=mod)
            drop = tile_dropout(dropout, bh, (r0, r1), (c0, c1), N_q, N_k, q.device)
            m_i, l_i, acc = update(m_i, l_i, acc, S_ij, v_j, drop)
            hbm[i] = (m_i, l_i, normalize(l_i, acc))  # write back (Alg. 1 lines 12-13)
    O = torch.cat([q.new_empty((*lead, 0, D_v)), *(O_i for _, _, O_i in hbm)], dim=-2)
    lse = torch.cat([q.new_empty((*lead, 0)), *(log_sum_exp(m_i, l_i) for m_i, l_i, _ in hbm)], dim=-1)
    return O, lse
