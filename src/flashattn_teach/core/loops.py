"""The two tile loops of FlashAttention's forward, around one update (``online_softmax.py``).

Both cut ``Q`` into query blocks ``i`` of ``block_m`` rows (the papers' ``B_r``) and ``K, V`` into key blocks
``j`` of ``block_n`` keys (``B_c``), and hold at most ``block_m x block_n`` scores per (batch, head) at once.
They differ in which loop is outside:

- :func:`query_major_attention`, FlashAttention-2 (Dao 2023, Alg. 1): for each query block ``i`` the state
  ``(m_i, l_i, acc)`` stays "on chip" while every key block streams past; ``O_i`` and ``lse_i`` are written
  once. Query blocks are independent: the GPU runs one per program.
- :func:`key_major_attention`, FlashAttention (Dao et al. 2022, Alg. 1): ``K_j, V_j`` are loaded once, and
  every query block's state is read from "HBM", updated and written back on every tile, ``O_i`` kept
  normalised as in the paper (lines 8, 12-13). FlashAttention-2 swapped the loops to remove that round trip.

Causal (top-left, query row ``i`` sees keys ``j <= i``): a tile entirely above the diagonal is skipped, a
tile the diagonal crosses is masked, every other tile runs unmasked. ``N`` need not divide by a block size
(the last block is short), and ``N_q != N_k`` is fine.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import AttentionValueError
from .dense import NEG_INF, causal_mask, check_inputs
from .online_softmax import finalize, init_state, log_sum_exp, normalize, update


def blocks(n: int, size: int) -> list[tuple[int, int]]:
    """``[(0, size), (size, 2 size), ..., (.., n)]``: the row or key ranges of the blocks; the last may be short."""
    if size < 1:
        raise AttentionValueError(f"block sizes must be positive integers, got {size}; try 64")
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def tile_mask(rows: tuple[int, int], cols: tuple[int, int], causal: bool, device: torch.device) -> Tensor | None:
    """The ``(Br, Bc)`` causal mask of a tile the diagonal crosses (its last key after its first row), else None."""
    return causal_mask(rows, cols, device) if causal and cols[1] - 1 > rows[0] else None


def score_tile(q_i: Tensor, k_j: Tensor, scale: float, mask: Tensor | None) -> Tensor:
    """``S_ij = scale * Q_i K_j^T``, ``-inf`` where ``mask`` is False."""
    S_ij = torch.matmul(q_i * scale, k_j.transpose(-2, -1))  # (B, H, Br, D) @ (B, H, D, Bc) -> (B, H, Br, Bc)
    return S_ij if mask is None else S_ij.masked_fill_(~mask, NEG_INF)


def visible(rows: tuple[int, int], cols: tuple[int, int], causal: bool) -> bool:
    """False for a tile entirely above the diagonal: its first key comes after its last row."""
    return not causal or cols[0] <= rows[1] - 1


def query_major_attention(
    q: Tensor, k: Tensor, v: Tensor,
    causal: bool = False, scale: float | None = None, block_m: int = 64, block_n: int = 64,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """FA2 Alg. 1: ``(O, lse)`` as :func:`~flashattn_teach.core.dense.dense_attention`, tile by tile."""
    scale = check_inputs(q, k, v, scale)
    B, H, N_q, _ = q.shape
    N_k, D_v = v.shape[-2], v.shape[-1]
    O, lse = q.new_empty((B, H, N_q, D_v)), q.new_empty((B, H, N_q))
    for r0, r1 in blocks(N_q, block_m):  # query block i (FA2 Alg. 1 line 3)
        q_i = q[:, :, r0:r1]  # (B, H, Br, D), loaded once (line 4)
        m_i, l_i, acc = init_state((B, H, r1 - r0), D_v, dtype=q.dtype, device=q.device)  # line 5
        for c0, c1 in blocks(N_k, block_n):  # key block j (lines 6-7)
            if not visible((r0, r1), (c0, c1), causal):
                break  # every later key block is further right, above the diagonal too
            mask = tile_mask((r0, r1), (c0, c1), causal, q.device)
            S_ij = score_tile(q_i, k[:, :, c0:c1], scale, mask)  # line 8
            m_i, l_i, acc = update(m_i, l_i, acc, S_ij, v[:, :, c0:c1])  # lines 9-10
        O[:, :, r0:r1], lse[:, :, r0:r1] = finalize(m_i, l_i, acc)  # lines 12-15, written once
    return O, lse


def key_major_attention(
    q: Tensor, k: Tensor, v: Tensor,
    causal: bool = False, scale: float | None = None, block_m: int = 64, block_n: int = 64,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """FA1 Alg. 1: the same ``(O, lse)``, key blocks outside, per-row statistics for every row in "HBM"."""
    scale = check_inputs(q, k, v, scale)
    B, H, N_q, _ = q.shape
    N_k, D_v = v.shape[-2], v.shape[-1]
    m, l, O = init_state((B, H, N_q), D_v, dtype=q.dtype, device=q.device)  # in HBM (Alg. 1 line 2)
    for c0, c1 in blocks(N_k, block_n):  # key block j (line 5): K_j, V_j loaded once (line 6)
        k_j, v_j = k[:, :, c0:c1], v[:, :, c0:c1]  # (B, H, Bc, D), (B, H, Bc, D_v)
        for r0, r1 in blocks(N_q, block_m):  # query block i (line 7)
            if not visible((r0, r1), (c0, c1), causal):
                continue  # this query block is above the diagonal; the next ones may not be
            m_i, l_i, O_i = m[:, :, r0:r1], l[:, :, r0:r1], O[:, :, r0:r1]  # read from HBM (line 8)
            acc = O_i * l_i.unsqueeze(-1)  # undo the stored normalisation: acc = diag(l_i) O_i
            mask = tile_mask((r0, r1), (c0, c1), causal, q.device)
            S_ij = score_tile(q[:, :, r0:r1], k_j, scale, mask)  # line 9
            m_i, l_i, acc = update(m_i, l_i, acc, S_ij, v_j)  # lines 10-11
            m[:, :, r0:r1], l[:, :, r0:r1] = m_i, l_i  # write back (line 13)
            O[:, :, r0:r1] = normalize(l_i, acc)  # O_i = diag(l_i)^-1 acc (line 12)
    return O, log_sum_exp(m, l)
