"""The score features of the full paths, around ``core/``'s plain ``S_ij = scale * Q_i K_j^T``.

In the order of :mod:`flashattn_teach.masks`: a softcap ``softcap * tanh(S / softcap)`` (Gemma 2), then an
additive bias (ALiBi, a float mask), then the user's ``score_mod`` (FlexAttention), then ``-inf`` where the
mask says no. :func:`score_hook` packs the first three, and their chain rule, into the ``scores`` hook of
:func:`flashattn_teach.core.backward.tile_terms`, so every backward runs the core tile terms with them:

    dS w.r.t. S = dS w.r.t. score_mod(S')  * d score_mod / dS'  * (1 - T^2),   T = tanh(S / softcap)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..core.backward import ScoreHook

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
