"""Public entry points of the tiled CPU references: ``online_attention`` and ``keymajor_attention``."""

from __future__ import annotations

import torch
from torch import Tensor

from .._validate import validate_block_sizes, validate_inputs
from .autograd import TiledAttentionFunction, tiled_forward
from .defaults import DEFAULT_BLOCK_M, DEFAULT_BLOCK_N


def _tiled(q, k, v, *, order, causal, causal_align, scale, enable_gqa, block_m, block_n, return_lse):
    s = validate_inputs(q, k, v, scale=scale, causal_align=causal_align, enable_gqa=enable_gqa)
    block_m, block_n = validate_block_sizes(block_m, block_n)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        O, lse = TiledAttentionFunction.apply(q, k, v, s, order, causal, causal_align, block_m, block_n)
    else:
        O, lse = tiled_forward(
            q, k, v, s, order=order, causal=causal, causal_align=causal_align, block_m=block_m, block_n=block_n
        )
    return (O, lse) if return_lse else O


def online_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    enable_gqa: bool = False,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention by query-major online softmax (the teaching example; FlashAttention-2's order).

    Args:
        q: ``(..., H_q, N_q, D)``; k: ``(..., H_kv, N_k, D)``; v: ``(..., H_kv, N_k, D_v)``, broadcasting
            as in torch's ``scaled_dot_product_attention``.
        causal, causal_align: see :mod:`flashattn_teach.causal`; key blocks wholly above the diagonal are
            skipped, not computed.
        scale: softmax scale, default ``1 / sqrt(D)``.
        enable_gqa: allow ``H_kv`` to divide ``H_q``.
        block_m, block_n: query and key tile sizes (``Br``, ``Bc`` in the papers); any sizes >= 1, they
            need not divide N.
        return_lse: also return ``lse = m + log l`` of shape ``(..., H_q, N_q)``.

    Returns:
        ``O`` of shape ``(..., H_q, N_q, D_v)`` in ``q``'s dtype (computed in float64 for float64 inputs,
        else float32), and ``lse`` in the compute dtype if asked. Differentiable: the backward is
        :func:`flashattn_teach.reference.flash_backward`, and only ``q, k, v, O, lse`` are saved.
    """
    return _tiled(
        q,
        k,
        v,
        order="query-major",
        causal=causal,
        causal_align=causal_align,
        scale=scale,
        enable_gqa=enable_gqa,
        block_m=block_m,
        block_n=block_n,
        return_lse=return_lse,
    )


def keymajor_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    enable_gqa: bool = False,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention in FlashAttention's Algorithm 1 order (key blocks outside, query blocks inside).

    Same arguments, results and backward as :func:`online_attention`; only the loop order and the
    per-tile read/write of ``O_i, l_i, m_i`` differ.
    """
    return _tiled(
        q,
        k,
        v,
        order="key-major",
        causal=causal,
        causal_align=causal_align,
        scale=scale,
        enable_gqa=enable_gqa,
        block_m=block_m,
        block_n=block_n,
        return_lse=return_lse,
    )
