"""Query-major online-softmax attention: the teaching example's algorithm, and FlashAttention-2's order.

For each query block ``i`` (rows ``[r0, r1)``) the running state ``(m_i, l_i, acc)`` lives "on chip" while
the loop streams key/value blocks ``j`` past it; ``O_i`` and ``lse_i`` are written once, at the end
(Dao 2023, FlashAttention-2, Alg. 1). At most ``block_m x block_n`` scores per (batch, head) exist at any
moment. Under causal masking the key blocks wholly above the diagonal are never visited.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import online_softmax as osm
from ..causal import TileKind, diagonal_offset, tile_kind, visible


def key_end(r1: int, N_k: int, causal: bool, offset: int) -> int:
    """One past the last key column any of the query rows ``< r1`` may see."""
    return N_k if not causal else max(0, min(N_k, r1 + offset))


def tile_mask(r0: int, r1: int, c0: int, c1: int, causal: bool, offset: int, device) -> Tensor | None:
    """The causal mask of one tile, or None when the tile is wholly visible (it then runs unmasked)."""
    if not causal or tile_kind(r0, r1, c0, c1, offset) is TileKind.FULL:
        return None
    rows = torch.arange(r0, r1, device=device)
    cols = torch.arange(c0, c1, device=device)
    return visible(rows, cols, offset)  # (Br, Bc)


def query_major_forward(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool, causal_align: str, block_m: int, block_n: int
) -> tuple[Tensor, Tensor]:
    """Grouped layout in, grouped layout out: ``q (B, H_kv, G, N_q, D)``, ``k (B, H_kv, 1, N_k, D)``,
    ``v (B, H_kv, 1, N_k, D_v)`` -> ``O (B, H_kv, G, N_q, D_v)``, ``lse (B, H_kv, G, N_q)``."""
    *lead, N_q, _ = q.shape
    N_k, D_v = v.shape[-2], v.shape[-1]
    offset = diagonal_offset(N_q, N_k, causal_align)
    O = q.new_empty((*lead, N_q, D_v))
    lse = q.new_empty((*lead, N_q))
    for r0 in range(0, N_q, block_m):  # query block i
        r1 = min(r0 + block_m, N_q)
        q_i = q[..., r0:r1, :]  # (B, H_kv, G, Br, D)
        m_i, l_i, acc = osm.init_state((*lead, r1 - r0), D_v, dtype=q.dtype, device=q.device)
        for c0 in range(0, key_end(r1, N_k, causal, offset), block_n):  # key block j
            c1 = min(c0 + block_n, N_k)
            allowed = tile_mask(r0, r1, c0, c1, causal, offset, q.device)
            S_ij = osm.score_tile(q_i, k[..., c0:c1, :], scale, allowed)  # (B, H_kv, G, Br, Bc)
            m_i, l_i, acc = osm.update(m_i, l_i, acc, S_ij, v[..., c0:c1, :])
        O[..., r0:r1, :], lse[..., r0:r1] = osm.finalize(m_i, l_i, acc)
    return O, lse
