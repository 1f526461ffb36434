"""The backward: recompute each tile's probabilities from the saved ``lse``, never storing ``N_q x N_k``.

The forward saved ``O`` and ``lse_i = m_i + log(l_i)``, so ``P_ij = exp(S_ij - lse_i)`` can be rebuilt one tile
at a time (Dao 2023, FlashAttention-2, Alg. 2). With ``delta_i = rowsum(dO_i * O_i)`` (line 4), which equals
``rowsum(P_i * dP_i)`` and so replaces the softmax backward's row sum, one tile contributes

    P_ij  = exp(S_ij - lse_i)            S_ij = scale * Q_i K_j^T        (line 11)
    dV_j += P_ij^T dO_i                                                   (line 12)
    dP_ij = dO_i V_j^T                                                    (line 13)
    dS_ij = P_ij * (dP_ij - delta_i)                                      (line 14)
    dQ_i += scale * dS_ij K_j                                             (line 15)
    dK_j += scale * dS_ij^T Q_i                                           (line 16)

:func:`tile_terms` is those lines, once: this file's loop, ``reference/backward.py``, the parallel CPU
backward and the backward replay all call it, so they cannot drift. Its two hooks let the full paths put
their features around the same equations: ``scores`` maps ``S`` to what the softmax sees (softcap, bias,
score_mod) and returns how ``dS`` goes back through it; ``drop`` is dropout's keep mask, applied to ``P`` in
``dV`` and to ``dP`` in ``dS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import AttentionValueError
from .dense import NEG_INF, check_inputs
from .loops import blocks, tile_mask, visible
from .online_softmax import Drop

# S -> (the scores the softmax sees, dS w.r.t. those -> dS w.r.t. S)
ScoreHook = Callable[[Tensor], tuple[Tensor, Callable[[Tensor], Tensor]]]


@dataclass(frozen=True)
class BackwardTerms:
    """One tile's terms: ``S, P, dP, dS (..., Br, Bc)``; the contributions ``dQ (..., Br, D)``,
    ``dK (..., Bc, D)``, ``dV (..., Bc, D_v)`` to be added to the accumulators (summed over any dims the
    caller broadcast). ``S`` is what the softmax saw; ``dS`` is w.r.t. ``scale * Q_i K_j^T``."""

    S: Tensor
    P: Tensor
    dP: Tensor
    dS: Tensor
    dQ: Tensor
    dK: Tensor
    dV: Tensor


def tile_terms(
    q_i: Tensor, k_j: Tensor, v_j: Tensor, do_i: Tensor, lse_i: Tensor, delta_i: Tensor, scale: float,
    mask: Tensor | None = None, *, scores: ScoreHook | None = None, drop: Drop | None = None,
) -> BackwardTerms:  # fmt: skip
    """FA2 Alg. 2 lines 11-16 for tile ``(i, j)``: ``q_i (..., Br, D)``, ``k_j (..., Bc, D)``, ``v_j (..., Bc,
    D_v)``, ``do_i (..., Br, D_v)``, ``lse_i, delta_i (..., Br)``; ``mask (Br, Bc)`` bool, True = may see (applied
    after ``scores``). A row with ``lse_i = -inf`` saw no key: its ``P`` is 0, not ``exp(-inf - -inf)``."""
    S = torch.matmul(q_i * scale, k_j.transpose(-2, -1))  # (..., Br, D) @ (..., D, Bc) -> (..., Br, Bc)
    back = None
    if scores is not None:
        S, back = scores(S)
    if mask is not None:
        S = S.masked_fill(~mask, NEG_INF)
    lse_i = torch.where(torch.isneginf(lse_i), float("inf"), lse_i)  # then exp(S - lse) = 0, not NaN
    P = torch.exp(S - lse_i.unsqueeze(-1))  # (..., Br, Bc), line 11
    P_v = P if drop is None else drop(P)
    dV = torch.matmul(P_v.transpose(-2, -1), do_i)  # (..., Bc, Br) @ (..., Br, D_v) -> (..., Bc, D_v)
    dP = torch.matmul(do_i, v_j.transpose(-2, -1))  # (..., Br, D_v) @ (..., D_v, Bc) -> (..., Br, Bc)
    dS = P * ((dP if drop is None else drop(dP)) - delta_i.unsqueeze(-1))  # line 14
    if back is not None:
        dS = back(dS)
    dQ = scale * torch.matmul(dS, k_j)  # (..., Br, Bc) @ (..., Bc, D) -> (..., Br, D)
    dK = scale * torch.matmul(dS.transpose(-2, -1), q_i)  # (..., Bc, Br) @ (..., Br, D) -> (..., Bc, D)
    return BackwardTerms(S, P, dP, dS, dQ, dK, dV)


def flash_backward(
    q: Tensor, k: Tensor, v: Tensor, O: Tensor, dO: Tensor, lse: Tensor,
    causal: bool = False, scale: float | None = None, block_m: int = 64, block_n: int = 64,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dq, dk, dv)`` of :func:`~flashattn_teach.core.dense.dense_attention` from its ``O (B, H, N_q, D_v)``
    and ``lse (B, H, N_q)`` and ``dO = dL/dO``: key blocks outside (``dK_j, dV_j`` on chip), query blocks inside."""
    scale = check_inputs(q, k, v, scale)
    if O.shape != dO.shape or O.shape[:-1] != lse.shape or O.shape[:-1] != q.shape[:-1]:
        raise AttentionValueError(
            f"O, dO must be (B, H, N_q, D_v) and lse (B, H, N_q) as the forward returned them, got O "
            f"{tuple(O.shape)}, dO {tuple(dO.shape)}, lse {tuple(lse.shape)} for q {tuple(q.shape)}"
        )
    delta = (dO * O).sum(dim=-1)  # (B, H, N_q), line 4: the preprocess
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for c0, c1 in blocks(k.shape[-2], block_n):  # key block j (line 5)
        k_j, v_j = k[:, :, c0:c1], v[:, :, c0:c1]  # (B, H, Bc, D), (B, H, Bc, D_v)
        for r0, r1 in blocks(q.shape[-2], block_m):  # query block i (line 8)
            if not visible((r0, r1), (c0, c1), causal):
                continue
            rows = slice(r0, r1)
            mask = tile_mask((r0, r1), (c0, c1), causal, q.device)  # (Br, Bc) or None
            t = tile_terms(q[:, :, rows], k_j, v_j, dO[:, :, rows], lse[:, :, rows], delta[:, :, rows], scale, mask)
            dv[:, :, c0:c1] += t.dV
            dk[:, :, c0:c1] += t.dK
            dq[:, :, rows] += t.dQ  # a GPU adds these atomically, or recomputes them in a dQ pass
    return dq, dk, dv
