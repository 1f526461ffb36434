"""Dense attention: the oracle every other path is checked against.

    S = scale * Q K^T                    (..., N_q, N_k)   -- the matrix FlashAttention never stores
    P = softmax(S)  row-wise
    O = P V                              (..., N_q, D_v)
    lse = log sum_j exp(S_ij)            (..., N_q)

It materialises the full ``N_q x N_k`` score matrix on purpose: it is the plain definition, written so a
reader can check it by eye, and it is differentiable by ordinary autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._layout import compute_dtype, pad_rank
from .._validate import validate_inputs
from ..causal import causal_mask


def dense_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    attn_mask: Tensor | None = None,
    enable_gqa: bool = False,
    dropout_p: float = 0.0,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention by the definition, holding all ``N_q x N_k`` scores.

    Args:
        q: ``(..., H_q, N_q, D)`` queries (or ``(N_q, D)``).
        k: ``(..., H_kv, N_k, D)`` keys; leading dims broadcast against ``q``.
        v: ``(..., H_kv, N_k, D_v)`` values.
        causal: mask keys "after" each query. With ``N_q = 3`` queries and ``N_k = 5`` keys
            (x = visible)::

                causal_align="top_left"        causal_align="bottom_right"
                (torch: j <= i)                (flash-attn: j <= i + N_k - N_q)
                      keys 0 1 2 3 4                 keys 0 1 2 3 4
                query 0    x . . . .           query 0    x x x . .
                query 1    x x . . .           query 1    x x x x .
                query 2    x x x . .           query 2    x x x x x

            ``bottom_right`` is what a decode step against a KV cache needs; see
            :mod:`flashattn_teach.causal`.
        scale: softmax scale, default ``1 / sqrt(D)``.
        attn_mask: bool (True = may attend) or additive float mask, broadcastable to
            ``(..., H_q, N_q, N_k)``; combined with ``causal`` if both are given.
        enable_gqa: allow ``H_kv`` to divide ``H_q`` (grouped-query attention).
        dropout_p: probability of zeroing an attention weight (applied to ``P``, survivors scaled by
            ``1 / (1 - dropout_p)``), as in torch's SDPA. Not applied to ``lse``.
        return_lse: also return ``lse``.

    Returns:
        ``O`` of shape ``(..., H_q, N_q, D_v)`` in ``q``'s dtype, and with ``return_lse`` also ``lse`` of
        shape ``(..., H_q, N_q)`` in the compute dtype (float64 for float64 inputs, else float32).
        A query row that sees no key gets ``O = 0`` and ``lse = -inf``.
    """
    s = validate_inputs(q, k, v, scale=scale, causal_align=causal_align, enable_gqa=enable_gqa, attn_mask=attn_mask)
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    dt = compute_dtype(q.dtype)
    qc, kc, vc = (pad_rank(t, s.rank).to(dt) for t in (q, k, v))
    if s.group > 1 and s.rank > 2:
        # GQA/MQA: query head h reads key/value head h // G (torch's repeat_interleave convention).
        kc = kc.repeat_interleave(s.group, dim=-3)
        vc = vc.repeat_interleave(s.group, dim=-3)

    S = torch.matmul(qc, kc.transpose(-2, -1)) * s.scale  # (..., N_q, D) @ (..., D, N_k) -> (..., N_q, N_k)
    allowed = None  # bool, broadcastable to S; None means every key is visible
    if causal:
        allowed = causal_mask(s.N_q, s.N_k, causal_align, device=q.device)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = attn_mask if allowed is None else allowed & attn_mask
        else:
            S = S + attn_mask.to(dt)
    if allowed is not None:
        S = S.masked_fill(~allowed, float("-inf"))

    # Rows with no visible key: softmax over all -inf is NaN, but the defined answer is O = 0, lse = -inf.
    # Give those rows harmless scores, then zero them, so neither value nor gradient becomes NaN.
    empty = torch.isneginf(S).all(dim=-1, keepdim=True)  # (..., N_q, 1)
    S_safe = S.masked_fill(empty, 0.0)
    lse = torch.logsumexp(S_safe, dim=-1)  # (..., N_q)
    P = torch.softmax(S_safe, dim=-1).masked_fill(empty, 0.0)  # (..., N_q, N_k)
    if dropout_p > 0.0:
        P = torch.nn.functional.dropout(P, p=dropout_p, training=True)
    O = torch.matmul(P, vc)  # (..., N_q, N_k) @ (..., N_k, D_v) -> (..., N_q, D_v)
    lse = lse.masked_fill(empty.squeeze(-1), float("-inf"))

    O = O.expand(s.out_shape).to(q.dtype)
    if return_lse:
        return O, lse.expand(s.lse_shape)
    return O
