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

``core/loops.py`` calls these functions, and so do the full CPU paths (``reference/``) and the tile replay
(``replay/``), so none of them can drift; ``core/kernel.py`` and the Triton kernels implement the same equations
in exp2 space. The two hooks the full paths need are here as arguments: ``sink`` (``init_state``) and ``drop``
(dropout on what reaches ``V``); the score features (softcap, bias, masks) are ``reference/scores.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

NEG_INF = float("-inf")
Drop = Callable[[Tensor], Tensor]  # dropout on the weights that reach V


def init_state(
    rows: tuple[int, ...],
    D_v: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    sink: Tensor | float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
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
    m_i: Tensor, l_i: Tensor, acc: Tensor, S_ij: Tensor, v_j: Tensor, drop: Drop | None = None
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
    m_i: Tensor, l_i: Tensor, acc: Tensor, S_ij: Tensor, v_j: Tensor, drop: Drop | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Fold one score tile into the running state; returns new ``(m_i, l_i, acc)``, inputs untouched.

    Shapes: ``m_i, l_i (..., Br)``, ``acc (..., Br, D_v)``, ``S_ij (..., Br, Bc)``, ``v_j (..., Bc, D_v)``.
    ``drop`` is dropout on the weights (``reference/tile_dropout.py``): it acts on what reaches ``V`` only,
    while ``l_i`` sums the undropped weights, so dropout applies to the normalised ``P`` (FlashAttention).
    The terms in between are :func:`update_terms`'s.
    """
    t = update_terms(m_i, l_i, acc, S_ij, v_j, drop)
    return t.m_new, t.l_new, t.acc_new


def update_(m_i: Tensor, l_i: Tensor, acc: Tensor, S_ij: Tensor, v_j: Tensor, drop: Drop | None = None) -> None:
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
