"""Changes from core/loops.py (``score_tile``): the score features of the full paths, around ``core/``'s
plain ``S_ij = scale * Q_i K_j^T``; moved here from ``core/online_softmax.py``, which keeps the update alone.

In the order of :mod:`flashattn_teach.masks`: a softcap ``softcap * tanh(S / softcap)`` (Gemma 2), then an
additive bias (ALiBi, a float mask), then the user's ``score_mod`` (FlexAttention), then ``-inf`` where the
mask says no (:func:`score_tile`). :func:`score_hook` packs the first three, and their chain rule, into the
``scores`` hook of :func:`flashattn_teach.core.backward.tile_terms`, so every backward runs the core tile terms
with them:

    dS w.r.t. S = dS w.r.t. score_mod(S')  * d score_mod / dS'  * (1 - T^2),   T = tanh(S / softcap)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..core.backward import ScoreHook
from ..core.online_softmax import NEG_INF

# S -> (score_mod(S), dS_out -> dS_in): masks.spec.Tiling.score_backward bound to a tile
ModBackward = Callable[[Tensor], tuple[Tensor, Callable[[Tensor], Tensor]]]


def score_hook(softcap: float | None, bias: Tensor | None, mod: ModBackward | None = None) -> ScoreHook | None:
    """The ``scores`` hook of ``tile_terms`` for a tile with these features; None when it has none."""
    if softcap is None and bias is None and mod is None:
        return None

    def scores(S: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
        T = None
        if softcap is not None:
            T = torch.tanh(S / softcap)  # (..., Br, Bc)
            S = softcap * T
        if bias is not None:
            S = S + bias
        mod_vjp = None
        if mod is not None:
            S, mod_vjp = mod(S)

        def back(dS: Tensor) -> Tensor:
            if mod_vjp is not None:
                dS = mod_vjp(dS)  # through score_mod: dS_in = dS_out * d score_mod / dS
            if T is not None:
                dS = dS * (1 - T * T)  # through the cap: d(softcap tanh(x / softcap)) / dx = 1 - T^2
            return dS

        return S, back

    return scores


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


def scale_tensor(scale: float, dtype: torch.dtype) -> Tensor:
    """``scale`` as a 0-d CPU tensor of ``dtype``, kept: ``q * scale_tensor(...)`` is ``q * scale`` (a 0-d
    operand is cast to ``q``'s dtype as a Python number is) without the tensor torch builds from a Python
    number on every call (about 2.5 us of a 3.8 us product at (1, 8, 16, 64)). Never handed out: nothing
    writes into it."""
    key = (scale, dtype)
    t = _SCALES.get(key)
    if t is None:
        if len(_SCALES) >= 64:
            _SCALES.clear()
        t = _SCALES[key] = torch.tensor(scale, dtype=dtype)
    return t


_SCALES: dict[tuple[float, torch.dtype], Tensor] = {}

# The lse of a call whose caller drops it (whole_row(..., with_lse=False)): zero elements, never read.
NO_LSE = torch.empty(0)


def whole_row(
    S: Tensor, v: Tensor, out: Tensor | None = None, *, with_lse: bool = True, bmm: bool = False
) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` when one tile ``S (..., N_q, N_k)`` holds every key of its rows and every row sees every
    key (no mask, no bias): the loop's one step, ``core.online_softmax.update`` from ``init_state`` (``alpha = 0``),
    then ``finalize`` (FA2 Alg. 1 with ``T_c = 1``). No row sees only masked keys, so ``m`` is finite
    and ``l >= 1`` (its largest term is ``exp(0)``): the ``-inf`` guards of the loop have nothing to do.

    With one tile the step and ``finalize`` are torch's fused softmax, one pass instead of four ops:
    ``P = exp(S - m) / l`` is the loop's ``P~ = exp(S - m)`` already divided by ``l``, so ``O = P V``; and
    the largest ``P~_ij`` of a row is ``exp(0) = 1``, so ``max_j P_ij = 1 / l_i`` and
    ``lse = m + log(l) = m - log(max_j P_ij)``. ``with_lse=False`` (a caller that drops ``lse``) runs the
    softmax and the product alone, the same ``O``, and gives :data:`NO_LSE` for ``lse``: four torch ops
    of the six fewer. ``bmm``: ``S`` and ``v`` are ``(n, ., .)`` of one ``n``, for ``torch.bmm`` (without
    ``torch.matmul``'s expands and views; it does not broadcast).

    ``S`` becomes ``P``, and ``O`` is written into ``out`` when given (a buffer of ``O``'s shape that no one
    else holds): pass a tile no one else holds (``score_tile``'s). Each buffer more than ``S`` and ``O``
    (``P`` apart from ``S``, the scaled ``Q`` apart from ``O``) made glibc hand the pages back to the system
    after a call at ``(2, 8, 128, 64)`` and fault them in again on the next, 470-600 page faults a call
    (``benchmarks/results/cpu/host_cost.md``). torch.func's transforms take no ``out=``: under them ``P``
    and ``O`` are new tensors."""
    in_place = not torch._C._are_functorch_transforms_active()
    m = S.amax(dim=-1) if with_lse else NO_LSE  # (..., N_q): the row maxima
    P = torch.softmax(S, dim=-1, out=S if in_place else None)  # (..., N_q, N_k): exp(S - m) / l
    product = torch.bmm if bmm else torch.matmul
    O = product(P, v, out=out if in_place else None)  # (..., N_q, N_k) @ (..., N_k, D_v) -> (..., N_q, D_v)
    if not with_lse:
        return O, NO_LSE
    return O, m.sub_(P.amax(dim=-1).log_())  # lse = m + log(l) = m - log(1 / l)
