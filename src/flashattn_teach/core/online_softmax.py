"""The online-softmax update: one tile of scores folded into running statistics.

This is the heart of FlashAttention (Milakov & Gimelshein 2018, "Online normalizer calculation for
softmax"; Dao et al. 2022, Alg. 1; Dao 2023, FlashAttention-2 Alg. 1). For one query block ``i`` the
running state is, per query row,

    m_i  running maximum of the scores seen so far
    l_i  running denominator  sum_j exp(S_ij - m_i)   (relative to m_i)
    acc  unnormalised output  sum_j exp(S_ij - m_i) V_j

and folding in the score tile ``S_ij`` of key block ``j`` is (FA2 Alg. 1 lines 8-10)

    m_new = max(m_i, rowmax(S_ij))
    alpha = exp(m_i - m_new)                 rescales what was accumulated under the old maximum
    P_ij  = exp(S_ij - m_new)
    l_new = alpha * l_i + rowsum(P_ij)
    acc   = alpha * acc + P_ij V_j

and at the end ``O_i = acc / l_i`` and ``lse_i = m_i + log(l_i)`` (FA2 Alg. 1 lines 12-13).

The query-major and key-major CPU references, the parallel CPU path and the tile replay all call these
functions, so they cannot drift apart; the Triton kernel implements the same equations in exp2 space.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

NEG_INF = float("-inf")


def init_state(
    rows: tuple[int, ...],
    D_v: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    sink: Tensor | float | None = None,
):
    """State before any key: ``m = -inf``, ``l = 0``, ``acc = 0``; shapes ``rows`` and ``(*rows, D_v)``.

    With an attention sink (``sink``: a number, or a tensor broadcastable to ``rows``) the state starts as if
    the row had already seen one key of score ``sink_h`` and value zero: ``m = sink_h``, ``l = exp(sink_h -
    m) = 1``, ``acc = 0``. The updates then fold the keys in unchanged, and :func:`finalize` gives ``lse_i =
    log(sum_j exp(S_ij) + exp(sink_h))`` and ``O_i = acc / l_i``; a row that sees no key ends as it started,
    ``O_i = 0``, ``lse_i = sink_h``."""
    acc = torch.zeros((*rows, D_v), dtype=dtype, device=device)
    if sink is None:
        m_i = torch.full(rows, NEG_INF, dtype=dtype, device=device)
        return m_i, torch.zeros(rows, dtype=dtype, device=device), acc
    if isinstance(sink, Tensor):
        m_i = sink.to(device=device, dtype=dtype).expand(rows).clone()  # the updates write m_i in place
    else:
        m_i = torch.full(rows, sink, dtype=dtype, device=device)
    return m_i, torch.ones(rows, dtype=dtype, device=device), acc


def score_tile(
    q_i: Tensor,
    k_j: Tensor,
    scale: float,
    allowed: Tensor | None = None,
    *,
    softcap: float | None = None,
    bias: Tensor | None = None,
    score_mod: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """``S_ij = scale * Q_i K_j^T``, capped, biased, modified and masked in the order of
    :mod:`flashattn_teach.masks`: ``softcap * tanh(S_ij / softcap)``, then ``+ bias``, then the user's
    ``score_mod`` (bound to the tile's indices), then ``-inf`` where ``allowed`` (bool) is False.
    ``allowed`` and ``bias`` broadcast against the tile."""
    # Scaling Q_i (Br x D) costs less than scaling S_ij (Br x Bc) whenever D < Bc.
    S_ij = torch.matmul(q_i * scale, k_j.transpose(-2, -1))  # (..., Br, D) @ (..., D, Bc) -> (..., Br, Bc)
    if softcap is not None:
        S_ij = soft_cap(S_ij, softcap)
    return bias_and_mask(S_ij, allowed, bias, score_mod)


def soft_cap(S_ij: Tensor, softcap: float) -> Tensor:
    """``softcap * tanh(S_ij / softcap)``: scores squashed into ``(-softcap, softcap)`` (Gemma 2)."""
    return torch.tanh(S_ij / softcap) * softcap


def bias_and_mask(
    S_ij: Tensor,
    allowed: Tensor | None,
    bias: Tensor | None,
    score_mod: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """``S_ij + bias``, then ``score_mod(S_ij)``, then ``-inf`` where ``allowed`` is False (a masked score
    stays masked whatever the bias or the user's function). Masks in place: callers pass a tile they own."""
    if bias is not None:
        S_ij = S_ij + bias
    if score_mod is not None:
        S_ij = score_mod(S_ij)
    if allowed is not None:
        S_ij.masked_fill_(~allowed, NEG_INF)
    return S_ij


@dataclass(frozen=True)
class UpdateTerms:
    """Every term of one update (FA2 Alg. 1 lines 9-10), as :func:`update_terms` computes them.

    Shapes: ``rowmax, m_new, alpha, rowsum, l_new (..., Br)``; ``P_ij (..., Br, Bc)``, undropped;
    ``PV, acc_new (..., Br, D_v)``, ``PV = P_ij V_j`` with dropout applied to ``P_ij`` when there is any.
    """

    rowmax: Tensor  # rowmax(S_ij); -inf for a row whose keys in this tile are all masked
    m_new: Tensor  # max(m_old, rowmax(S_ij))
    alpha: Tensor  # exp(m_old - m_new), with -inf - -inf taken as exp(-inf - 0) = 0
    P_ij: Tensor  # exp(S_ij - m_new)
    rowsum: Tensor  # rowsum(P_ij)
    l_new: Tensor  # alpha * l_old + rowsum(P_ij)
    PV: Tensor  # P_ij V_j
    acc_new: Tensor  # alpha * acc_old + P_ij V_j


def update_terms(
    m_i: Tensor,
    l_i: Tensor,
    acc: Tensor,
    S_ij: Tensor,
    v_j: Tensor,
    drop: Callable[[Tensor], Tensor] | None = None,
) -> UpdateTerms:
    """Fold one score tile into the running state and keep every intermediate term; inputs untouched.

    Shapes and ``drop`` as in :func:`update`, which returns ``(m_new, l_new, acc_new)`` of these terms.
    """
    rowmax = S_ij.amax(dim=-1)  # (..., Br)
    m_new = torch.maximum(m_i, rowmax)  # FA2 Alg. 1 line 9
    # A row that has seen only masked keys keeps m = -inf; subtracting 0 instead avoids (-inf) - (-inf).
    m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
    alpha = torch.exp(m_i - m_safe)  # (..., Br); 0 on the first visible tile since m_i = -inf
    P_ij = (S_ij - m_safe.unsqueeze(-1)).exp_()  # (..., Br, Bc)
    rowsum = P_ij.sum(dim=-1)  # (..., Br)
    l_new = alpha * l_i + rowsum  # FA2 Alg. 1 line 9
    # Dropout reaches V only; l_new summed the undropped weights.
    PV = torch.matmul(P_ij if drop is None else drop(P_ij), v_j)  # (..., Br, Bc) @ (..., Bc, D_v)
    acc_new = PV + acc * alpha.unsqueeze(-1)  # FA2 Alg. 1 line 10
    return UpdateTerms(rowmax, m_new, alpha, P_ij, rowsum, l_new, PV, acc_new)


def update(
    m_i: Tensor,
    l_i: Tensor,
    acc: Tensor,
    S_ij: Tensor,
    v_j: Tensor,
    drop: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Fold one score tile into the running state; returns new ``(m_i, l_i, acc)``, inputs untouched.

    Shapes: ``m_i, l_i (..., Br)``, ``acc (..., Br, D_v)``, ``S_ij (..., Br, Bc)``, ``v_j (..., Bc, D_v)``.
    ``drop`` is dropout on the weights (``reference/tile_dropout.py``): it acts on what reaches ``V`` only,
    while ``l_i`` sums the undropped weights, so dropout applies to the normalised ``P`` (FlashAttention).
    The terms in between are :func:`update_terms`'s.
    """
    t = update_terms(m_i, l_i, acc, S_ij, v_j, drop)
    return t.m_new, t.l_new, t.acc_new


def update_(
    m_i: Tensor,
    l_i: Tensor,
    acc: Tensor,
    S_ij: Tensor,
    v_j: Tensor,
    drop: Callable[[Tensor], Tensor] | None = None,
) -> None:
    """:func:`update` in place, for one head: ``m_i, l_i, acc`` are updated and ``S_ij`` becomes ``P_ij``
    (undropped; ``drop`` as in :func:`update`).

    Shapes: ``m_i, l_i (Br,)``, ``acc (Br, D_v)``, ``S_ij (Br, Bc)``, ``v_j (Bc, D_v)``. The same equations
    and the same ``-inf`` guard, in fewer passes over the tile and without a ``Br x Bc`` allocation, for the
    parallel CPU path (``reference/parallel.py``), whose per-tile cost is these ops.
    """
    m_new = torch.maximum(m_i, S_ij.amax(dim=-1))  # (Br,)
    # A row that has seen only masked keys keeps m = -inf; subtracting 0 instead avoids (-inf) - (-inf).
    m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
    P_ij = S_ij.sub_(m_safe.unsqueeze(-1)).exp_()  # (Br, Bc)
    alpha = m_i.sub_(m_safe).exp_()  # (Br,); 0 on the first visible tile since m_i = -inf
    l_i.mul_(alpha).add_(P_ij.sum(dim=-1))
    P_v = P_ij if drop is None else drop(P_ij)  # dropout reaches V only; l_i summed the undropped weights
    acc.mul_(alpha.unsqueeze(-1)).addmm_(P_v, v_j)  # (Br, Bc) @ (Bc, D_v) -> (Br, D_v), added to acc
    m_i.copy_(m_new)


def whole_row(S: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` when one tile ``S (..., N_q, N_k)`` holds every key of its rows and every row sees every
    key (no mask, no bias): the loop's one step, :func:`update` from :func:`init_state` (``alpha = 0``),
    then :func:`finalize` (FA2 Alg. 1 with ``T_c = 1``). No row sees only masked keys, so ``m`` is finite
    and ``l >= 1`` (its largest term is ``exp(0)``): the ``-inf`` guards of the loop have nothing to do.
    ``S`` becomes ``P``: pass a tile no one else holds (``score_tile``'s)."""
    m = S.amax(dim=-1, keepdim=True)  # (..., N_q, 1)
    P = S.sub_(m).exp_()  # (..., N_q, N_k), in place: S is the caller's fresh tile, consumed here
    l = P.sum(dim=-1, keepdim=True)  # (..., N_q, 1)
    O = torch.matmul(P, v).div_(l)  # (..., N_q, N_k) @ (..., N_k, D_v), then / l
    return O, l.log_().add_(m).squeeze(-1)  # lse = m + log(l)


def normalize(l_i: Tensor, acc: Tensor) -> Tensor:
    """``acc / l_i``: the attention output over the keys seen so far (0 for a row that saw none)."""
    return acc / torch.where(l_i == 0, 1.0, l_i).unsqueeze(-1)  # acc is 0 wherever l_i is 0


def log_sum_exp(m_i: Tensor, l_i: Tensor) -> Tensor:
    """``lse_i = m_i + log(l_i)``, and ``-inf`` for a row that saw no key (l_i = 0)."""
    empty = l_i == 0
    return torch.where(empty, NEG_INF, m_i + torch.log(torch.where(empty, 1.0, l_i)))


def finalize(m_i: Tensor, l_i: Tensor, acc: Tensor) -> tuple[Tensor, Tensor]:
    """``O_i = acc / l_i`` and ``lse_i = m_i + log(l_i)`` (FA2 Alg. 1 lines 12-13)."""
    return normalize(l_i, acc), log_sum_exp(m_i, l_i)


def sink_grad(sinks: Tensor, lse: Tensor, O: Tensor, dO: Tensor | None, dlse: Tensor | None) -> Tensor:
    """``dsink_h`` of attention sinks ``(H_q,)`` from a forward's ``O (..., H_q, N_q, D_v)`` and ``lse (...,
    H_q, N_q)`` (sink included) and the gradients ``dO``, ``dlse`` of those (None: zero); in ``sinks``' dtype.

    The sink's weight in row ``i`` is ``p_i = exp(sink_h - lse_i)``. ``lse_i`` depends on the sink through
    ``d lse_i / d sink_h = p_i``, and ``O_i = sum_j exp(S_ij - lse_i) V_j`` through ``lse_i`` alone, so
    ``d O_i / d sink_h = -p_i O_i`` and, with ``delta_i = rowsum(dO_i * O_i)`` (FA2's ``D_i``),

        dsink_h = sum_{b, i} p_i (dlse_i - delta_i)

    O(B H N) work from what the backward holds anyway; nothing of size ``N_q x N_k``. Dropout changes
    nothing here: the dropped ``O`` still depends on the sink through ``lse`` alone."""
    per_head = lse.dim() >= 2  # (..., H_q, N_q); a 2-D call's lse is (N_q,), its one sink (1,)
    s = sinks.to(lse.dtype).reshape(-1, 1) if per_head else sinks.to(lse.dtype)
    # p = exp(sink - lse) <= 1; lse = -inf only where sink = -inf too (p = 0 there, not exp(-inf + inf))
    p = torch.where(torch.isneginf(lse), 0.0, torch.exp(s - lse))  # (..., H_q, N_q)
    g = torch.zeros_like(p)
    if dO is not None:
        g = g - p * (dO.to(lse.dtype) * O.to(lse.dtype)).sum(dim=-1)  # - p_i delta_i
    if dlse is not None:
        g = g + p * dlse.to(lse.dtype)
    # a sum over every dim but the head's, not a reshape to (-1, H_q, N_q): that one is ambiguous (an error)
    # when there are no rows (N_q = 0, an empty chunk of a chunked prefill), which give dsink = 0
    dsink = g.sum(dim=[*range(g.dim() - 2), g.dim() - 1]) if per_head else g.sum().reshape(1)
    return dsink.to(sinks.dtype)
