"""Forward-mode derivative (the jvp) of attention, tile by tile from the saved ``lse``.

With tangents ``tq, tk, tv`` of the inputs, ``tS_ij = scale * (tq_i K_j^T + Q_i tk_j^T)`` and, since
``P_ij = exp(S_ij - lse_i)`` and ``O_i = sum_j P_ij V_j``,

    tlse_i = sum_j rowsum(P_ij * tS_ij)
    tO_i   = sum_j (P_ij * tS_ij) V_j  -  tlse_i * O_i  +  sum_j P_ij tv_j

one pass over the same tiles as the forward, holding at most ``block_m x block_n`` scores per
(batch, head): what ``torch.func.jvp`` needs, without the ``N_q x N_k`` matrix.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..causal import diagonal_offset, key_end, tile_mask
from ..online_softmax import score_tile


def jvp_grouped(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    O: Tensor,
    lse: Tensor,
    tq: Tensor,
    tk: Tensor,
    tv: Tensor,
    *,
    scale: float,
    causal: bool,
    causal_align: str,
    block_m: int,
    block_n: int,
) -> tuple[Tensor, Tensor]:
    """Grouped layout (see ``_layout.py``), tangents shaped like their inputs; returns ``(tO, tlse)``."""
    *lead, N_q, _ = q.shape
    N_k, D_v = v.shape[-2], v.shape[-1]
    offset = diagonal_offset(N_q, N_k, causal_align)
    # Rows that saw no key have lse = -inf and P = 0: use +inf so exp(S - lse) is 0, not NaN.
    lse_safe = torch.where(torch.isneginf(lse), float("inf"), lse)
    tO_blocks, tlse_blocks = [q.new_empty((*lead, 0, D_v))], [q.new_empty((*lead, 0))]
    for r0 in range(0, N_q, block_m):  # query block i
        r1 = min(r0 + block_m, N_q)
        q_i, tq_i = q[..., r0:r1, :], tq[..., r0:r1, :]
        tlse_i = torch.zeros_like(lse[..., r0:r1])  # (B, H_kv, G, Br)
        A_i = torch.zeros_like(O[..., r0:r1, :])  # sum_j (P * tS) V_j + P tv_j, (B, H_kv, G, Br, D_v)
        for c0 in range(0, key_end(r1, N_k, causal, offset), block_n):  # key block j
            c1 = min(c0 + block_n, N_k)
            k_j, tk_j = k[..., c0:c1, :], tk[..., c0:c1, :]
            allowed = tile_mask(r0, r1, c0, c1, causal, offset, q.device)
            P_ij = torch.exp(score_tile(q_i, k_j, scale, allowed) - lse_safe[..., r0:r1, None])  # (.., Br, Bc)
            # (.., Br, D) @ (.., D, Bc) twice -> (.., Br, Bc)
            tS_ij = scale * (tq_i @ k_j.transpose(-2, -1) + q_i @ tk_j.transpose(-2, -1))
            PtS_ij = P_ij * tS_ij
            tlse_i = tlse_i + PtS_ij.sum(dim=-1)
            A_i = A_i + PtS_ij @ v[..., c0:c1, :] + P_ij @ tv[..., c0:c1, :]  # (.., Br, Bc) @ (.., Bc, D_v)
        tO_blocks.append(A_i - tlse_i.unsqueeze(-1) * O[..., r0:r1, :])
        tlse_blocks.append(tlse_i)
    return torch.cat(tO_blocks, dim=-2), torch.cat(tlse_blocks, dim=-1)
