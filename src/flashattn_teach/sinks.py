"""The gradient of attention sinks (one learned logit per query head in every softmax row: GPT-OSS's
``s_aux``), shared by the CPU autograd, the custom op and the Triton autograd; the forward's side of a sink is
``core.online_softmax.init_state(..., sink=)``, its check ``_validate/sinks.py``."""

from __future__ import annotations

import torch
from torch import Tensor


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
