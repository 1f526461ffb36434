"""Autograd glue: the fused forward and the three backward kernels as one differentiable function.

Saved for backward: ``q, k, v, O, lse`` only (O(N) memory); ``P`` is recomputed by the backward kernels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._layout import grad_to_input
from .._validate import AttentionShapes
from . import launch
from .configs import AttentionConfig


class TritonAttentionFunction(torch.autograd.Function):
    """``(q, k, v) -> (O, lse)`` in the user's layout; backward also accepts a gradient into ``lse``."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        s: AttentionShapes,
        causal: bool,
        causal_align: str,
        config: AttentionConfig,
    ) -> tuple[Tensor, Tensor]:
        q4, k4, v4 = launch.to_4d(q, s, s.H_q), launch.to_4d(k, s, s.H_kv), launch.to_4d(v, s, s.H_kv)
        o4, lse3 = launch.forward(q4, k4, v4, s, causal=causal, causal_align=causal_align, config=config)
        ctx.save_for_backward(q, k, v, o4, lse3)
        ctx.config = (s, causal, causal_align, config)
        return o4.reshape(s.out_shape), lse3.reshape(s.lse_shape)

    @staticmethod
    def backward(ctx: Any, dO: Tensor | None, dlse: Tensor | None):
        q, k, v, o4, lse3 = ctx.saved_tensors
        s, causal, causal_align, config = ctx.config
        q4, k4, v4 = launch.to_4d(q, s, s.H_q), launch.to_4d(k, s, s.H_kv), launch.to_4d(v, s, s.H_kv)
        do4 = torch.zeros_like(o4) if dO is None else launch.to_4d(dO, s, s.H_q)
        dlse3 = None if dlse is None else dlse.reshape(lse3.shape)
        dq4, dk4, dv4 = launch.backward(
            q4, k4, v4, o4, lse3, do4, dlse3, s, causal=causal, causal_align=causal_align, config=config
        )
        # (B, H, N, X) -> (B, H, 1, N, X), the grouped layout grad_to_input undoes broadcasting from
        return (
            grad_to_input(dq4.unsqueeze(2), q, s),
            grad_to_input(dk4.unsqueeze(2), k, s),
            grad_to_input(dv4.unsqueeze(2), v, s),
            None,
            None,
            None,
            None,
        )
