"""Forward-mode derivative (the jvp) of attention, tile by tile from the saved ``lse``.

With tangents ``tq, tk, tv`` of the inputs, ``tS_ij = scale * (tq_i K_j^T + Q_i tk_j^T)`` and, since
``P_ij = exp(S_ij - lse_i)`` and ``O_i = sum_j P_ij V_j``,

    tlse_i = sum_j rowsum(P_ij * tS_ij)
    tO_i   = sum_j (P_ij * tS_ij) V_j  -  tlse_i * O_i  +  sum_j P_ij tv_j

With a softcap, ``S = softcap * T`` with ``T = tanh(scale Q K^T / softcap)``, so ``tS`` is multiplied by
``1 - T^2``; a bias does not depend on ``q, k`` and adds nothing to ``tS``. One pass over the same tiles as the
forward (:mod:`flashattn_teach.masks`), holding at most ``block_m x block_n`` scores per
(batch, head): what ``torch.func.jvp`` needs, without the ``N_q x N_k`` matrix.

With dropout (mask ``Z``, ``s = 1 / (1 - p)``, drawn again from the forward's key: ``tile_dropout.py``),
``O_i = sum_j (P_ij * Z_ij s) V_j`` while ``lse`` sums the undropped weights, so ``tlse_i`` is unchanged and
``P_ij`` is replaced by ``P_ij * Z_ij s`` in the two terms of ``tO_i`` that reach ``V`` or ``tv``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..dropout import DropoutKey
from ..masks.spec import Tiling
from .scores import bias_and_mask
from .tile_dropout import NO_DROPOUT, grouped_heads, tile_dropout


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
    tiling: Tiling,
    dropout: DropoutKey = NO_DROPOUT,
) -> tuple[Tensor, Tensor]:
    """Grouped layout (see ``_layout.py``), tangents shaped like their inputs; returns ``(tO, tlse)``.
    ``dropout`` is the forward's key."""
    lead = q.shape[:-2]
    D_v = v.shape[-1]
    N_q, N_k = q.shape[-2], k.shape[-2]
    softcap = tiling.spec.softcap
    bh = grouped_heads(q)  # (B, H_kv, G, 1, 1): b * H_q + h, the dropout's head index
    # Rows that saw no key have lse = -inf and P = 0: use +inf so exp(S - lse) is 0, not NaN.
    lse_safe = torch.where(torch.isneginf(lse), float("inf"), lse)
    tO_blocks, tlse_blocks = [q.new_empty((*lead, 0, D_v))], [q.new_empty((*lead, 0))]
    for i, (r0, r1) in enumerate(tiling.row_blocks):  # query block i
        q_i, tq_i = q[..., r0:r1, :], tq[..., r0:r1, :]
        tlse_i = torch.zeros_like(lse[..., r0:r1])  # (B, H_kv, G, Br)
        A_i = torch.zeros_like(O[..., r0:r1, :])  # sum_j (P * tS) V_j + P tv_j, (B, H_kv, G, Br, D_v)
        for j in tiling.key_blocks(i):  # key block j, SKIP tiles left out
            c0, c1 = tiling.col_blocks[j]
            k_j, tk_j = k[..., c0:c1, :], tk[..., c0:c1, :]
            allowed, bias = tiling.tile(i, j, q.device)
            S_ij = torch.matmul(q_i * scale, k_j.transpose(-2, -1))  # (.., Br, D) @ (.., D, Bc) -> (.., Br, Bc)
            # (.., Br, D) @ (.., D, Bc) twice -> (.., Br, Bc)
            tS_ij = scale * (tq_i @ k_j.transpose(-2, -1) + q_i @ tk_j.transpose(-2, -1))
            if softcap is not None:
                T_ij = torch.tanh(S_ij / softcap)
                S_ij, tS_ij = softcap * T_ij, tS_ij * (1 - T_ij * T_ij)
            P_ij = torch.exp(bias_and_mask(S_ij, allowed, bias) - lse_safe[..., r0:r1, None])  # (.., Br, Bc)
            PtS_ij = P_ij * tS_ij
            tlse_i = tlse_i + PtS_ij.sum(dim=-1)  # lse sums the undropped weights
            drop = tile_dropout(dropout, bh, (r0, r1), (c0, c1), N_q, N_k, q.device)  # the forward's mask
            # (.., Br, Bc) @ (.., Bc, D_v) twice -> (.., Br, D_v)
            A_i = A_i + drop(PtS_ij) @ v[..., c0:c1, :] + drop(P_ij) @ tv[..., c0:c1, :]
        tO_blocks.append(A_i - tlse_i.unsqueeze(-1) * O[..., r0:r1, :])
        tlse_blocks.append(tlse_i)
    return torch.cat(tO_blocks, dim=-2), torch.cat(tlse_blocks, dim=-1)
