"""Dropout on one tile of attention weights, by the weights' places in the whole score matrix.

Every tiled CPU path (query-major, key-major, parallel, the backward and the forward-mode derivative)
drops the weights of tile ``(i, j)`` with the keep mask ``Z`` of :mod:`flashattn_teach.dropout`, drawn from
each weight's batch element, query head, row and column in the whole ``N_q x N_k`` matrix, never from its
place in the tile; so any tiling, either loop order, the backward's regenerated mask and the dense oracle
agree weight for weight. With ``s = 1 / (1 - p)`` (Dao et al. 2022, Alg. 2 lines 11-14 and Alg. 4)::

    l_i, lse_i  sum the undropped weights          dropout acts on the normalised P, after the softmax
    O_i         = sum_j (P_ij * Z_ij s) V_j
    dV_j       += (P_ij * Z_ij s)^T dO_i
    dS_ij       = P_ij * (dP_ij * Z_ij s - delta_i),   dP_ij = dO_i V_j^T,  delta_i = rowsum(dO_i * O_i)

``delta_i`` keeps its form because ``rowsum(P * (dP * Z s)) = rowsum(dO * (P Z s) V) = rowsum(dO * O)``.
The forward-mode derivative follows the same way: ``tlse`` from the undropped ``P``, and
``tO_i = sum_j (P_ij * tS_ij * Z_ij s) V_j + (P_ij * Z_ij s) tv_j - tlse_i O_i``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..dropout import DropoutKey, counters, keep_mask

NO_DROPOUT = DropoutKey()  # p = 0: the default of every tiled loop


def _identity(X: Tensor) -> Tensor:
    return X


def grouped_heads(q: Tensor) -> Tensor:
    """``b * H_q + h`` of every head of the grouped layout ``q (B, H_kv, G, ., .)``, as ``(B, H_kv, G, 1, 1)``
    int64: query head ``h = h_kv * G + g``, so the flat index of ``(b, h_kv, g)`` is the dropout's ``bh``."""
    B, H_kv, G = q.shape[:3]
    return torch.arange(B * H_kv * G, device=q.device).reshape(B, H_kv, G, 1, 1)


def tile_dropout(
    key: DropoutKey,
    bh: Tensor | int,
    rows: tuple[int, int],
    cols: tuple[int, int],
    N_q: int,
    N_k: int,
    device: torch.device,
) -> Callable[[Tensor], Tensor]:
    """``X -> X * Z s`` for tiles ``X`` of the weights at query rows ``[r0, r1)`` and key columns
    ``[c0, c1)`` of heads ``bh`` (an int, or a tensor that broadcasts against the tile); the keep mask is
    drawn once and applies to ``P_ij`` and ``dP_ij`` alike. The identity when ``key.p = 0``."""
    if key.p == 0.0:
        return _identity
    (r0, r1), (c0, c1) = rows, cols
    i = torch.arange(r0, r1, device=device)[:, None]  # (Br, 1)
    j = torch.arange(c0, c1, device=device)[None, :]  # (1, Bc)
    keep = keep_mask(key, counters(key, bh, i, j, N_q, N_k))  # bh's shape broadcast with (Br, Bc)
    s = key.keep_scale

    def drop(X: Tensor) -> Tensor:
        return torch.where(keep, X * s, 0.0)  # dropout.drop's arithmetic, the mask drawn once

    return drop
