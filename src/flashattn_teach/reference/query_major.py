"""Query-major online-softmax attention: the teaching example's algorithm, and FlashAttention-2's order.

For each query block ``i`` (rows ``[r0, r1)``) the running state ``(m_i, l_i, acc)`` lives "on chip" while
the loop streams key/value blocks ``j`` past it; ``O_i`` and ``lse_i`` are written once, at the end
(Dao 2023, FlashAttention-2, Alg. 1). At most ``block_m x block_n`` scores per (batch, head) exist at any
moment. Under causal masking the key blocks wholly above the diagonal are never visited.

The blocks are collected and concatenated rather than written into a preallocated output, so the loop is
a pure function of its inputs and ``torch.func.vmap`` can run it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import online_softmax as osm
from ..causal import diagonal_offset, key_end, tile_mask


def query_major_forward(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool, causal_align: str, block_m: int, block_n: int
) -> tuple[Tensor, Tensor]:
    """Grouped layout in, grouped layout out: ``q (B, H_kv, G, N_q, D)``, ``k (B, H_kv, 1, N_k, D)``,
    ``v (B, H_kv, 1, N_k, D_v)`` -> ``O (B, H_kv, G, N_q, D_v)``, ``lse (B, H_kv, G, N_q)``."""
    *lead, N_q, _ = q.shape
    N_k, D_v = v.shape[-2], v.shape[-1]
    offset = diagonal_offset(N_q, N_k, causal_align)
    O_blocks, lse_blocks = [q.new_empty((*lead, 0, D_v))], [q.new_empty((*lead, 0))]
    for r0 in range(0, N_q, block_m):  # query block i
        r1 = min(r0 + block_m, N_q)
        q_i = q[..., r0:r1, :]  # (B, H_kv, G, Br, D)
        m_i, l_i, acc = osm.init_state((*lead, r1 - r0), D_v, dtype=q.dtype, device=q.device)
        for c0 in range(0, key_end(r1, N_k, causal, offset), block_n):  # key block j
            c1 = min(c0 + block_n, N_k)
            allowed = tile_mask(r0, r1, c0, c1, causal, offset, q.device)
            S_ij = osm.score_tile(q_i, k[..., c0:c1, :], scale, allowed)  # (B, H_kv, G, Br, Bc)
            m_i, l_i, acc = osm.update(m_i, l_i, acc, S_ij, v[..., c0:c1, :])
        O_i, lse_i = osm.finalize(m_i, l_i, acc)
        O_blocks.append(O_i)
        lse_blocks.append(lse_i)
    return torch.cat(O_blocks, dim=-2), torch.cat(lse_blocks, dim=-1)
