"""Autograd glue: the tiled forward and the memory-efficient backward as one differentiable function.

Saved for backward: ``q, k, v, O, lse`` only (O(N) memory); ``P`` is recomputed in ``backward``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._layout import from_grouped, grad_to_input, lse_from_grouped, pad_rank, to_grouped
from .._validate import AttentionShapes
from .backward import backward_grouped
from .key_major import key_major_forward
from .query_major import query_major_forward

FORWARDS = {"query-major": query_major_forward, "key-major": key_major_forward}


def tiled_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    s: AttentionShapes,
    *,
    order: str,
    causal: bool,
    causal_align: str,
    block_m: int,
    block_n: int,
) -> tuple[Tensor, Tensor]:
    """User layout in, ``(O, lse)`` out: ``O`` in ``q``'s dtype, ``lse`` in the compute dtype."""
    qg, kg, vg = to_grouped(q, k, v, s)
    O, lse = FORWARDS[order](
        qg, kg, vg, scale=s.scale, causal=causal, causal_align=causal_align, block_m=block_m, block_n=block_n
    )
    return from_grouped(O, s).to(q.dtype), lse_from_grouped(lse, s)


class TiledAttentionFunction(torch.autograd.Function):
    """``(q, k, v) -> (O, lse)``; backward is :func:`backward_grouped`, which also accepts ``dlse``."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        s: AttentionShapes,
        order: str,
        causal: bool,
        causal_align: str,
        block_m: int,
        block_n: int,
    ) -> tuple[Tensor, Tensor]:
        O, lse = tiled_forward(
            q, k, v, s, order=order, causal=causal, causal_align=causal_align, block_m=block_m, block_n=block_n
        )
        ctx.save_for_backward(q, k, v, O, lse)
        ctx.config = (s, causal, causal_align, block_m, block_n)
        return O, lse

    @staticmethod
    def backward(ctx: Any, dO: Tensor | None, dlse: Tensor | None):
        q, k, v, O, lse = ctx.saved_tensors
        s, causal, causal_align, block_m, block_n = ctx.config
        qg, kg, vg = to_grouped(q, k, v, s)
        B, H_kv, G = qg.shape[:3]
        dt = qg.dtype
        rank = max(s.rank, 3)
        Og = pad_rank(O, rank).to(dt).reshape(B, H_kv, G, s.N_q, s.D_v)
        dOg = torch.zeros_like(Og) if dO is None else pad_rank(dO, rank).to(dt).reshape(Og.shape)
        lseg = lse.reshape(B, H_kv, G, s.N_q)
        dlseg = None if dlse is None else dlse.to(dt).reshape(lseg.shape)
        dq, dk, dv = backward_grouped(
            qg,
            kg,
            vg,
            Og,
            lseg,
            dOg,
            dlseg,
            scale=s.scale,
            causal=causal,
            causal_align=causal_align,
            block_m=block_m,
            block_n=block_n,
        )
        return (
            grad_to_input(dq, q, s),
            grad_to_input(dk, k, s),
            grad_to_input(dv, v, s),
            None,
            None,
            None,
            None,
            None,
            None,
        )
