"""Changes from core/dense.py: the oracle of every option the library takes, so that each full path has
one to be checked against: 3-D inputs and grouped-query heads (``enable_gqa``), bottom-right causal alignment,
a sliding ``window``, ``softcap``, ALiBi, ``seqlens_k``, a bool or additive ``attn_mask``, FlexAttention's
``score_mod``/``mask_mod``/``block_mask``, attention ``sinks`` and ``dropout_p``; ``lse`` only on request.

Dense attention: the oracle every other path is checked against.

    S = (scale * Q) K^T                  (..., N_q, N_k)   -- the matrix FlashAttention never stores
    P = softmax(S)  row-wise
    O = P V                              (..., N_q, D_v)
    lse = log sum_j exp(S_ij)            (..., N_q)

With ``dropout_p`` the weights that reach ``V`` are ``P * Z / (1 - dropout_p)``, ``Z`` the keep mask of
:mod:`flashattn_teach.dropout` at each weight's (batch element, query head, row, column): the mask every
tiled path and the backward draw, so they can all be compared with this one exactly. ``lse`` is undropped.

It materialises the full ``N_q x N_k`` score matrix on purpose: it is the plain definition, written so a
reader can check it by eye, and it is differentiable by ordinary autograd.
"""

from __future__ import annotations

import math
from typing import Literal, overload

import torch
from torch import Tensor
from typing_extensions import Unpack

from .._autocast import autocast_off, cast_inputs
from .._layout import compute_dtype, pad_rank
from .._options import AttentionKeywords, AttentionOptions, make_options
from .._validate.inputs import check_bool
from .._validate.keywords import collects_keywords
from ..dropout import drop
from .scores import soft_cap


# The one pair of signatures kept written out: return_lse decides the result's type, which mypy reads from them.
@overload
def dense_attention(
    q: Tensor, k: Tensor, v: Tensor, *, return_lse: Literal[False] = False, **options: Unpack[AttentionKeywords]
) -> Tensor: ...
@overload
def dense_attention(
    q: Tensor, k: Tensor, v: Tensor, *, return_lse: Literal[True], **options: Unpack[AttentionKeywords]
) -> tuple[Tensor, Tensor]: ...


@collects_keywords()
def dense_attention(
    q: Tensor, k: Tensor, v: Tensor, *, options: AttentionKeywords, return_lse: bool = False
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
            :mod:`flashattn_teach.masks.causal`.
        scale: softmax scale, default ``1 / sqrt(D)``.
        attn_mask: bool (True = may attend) or additive float mask, broadcastable to
            ``(..., H_q, N_q, N_k)``; combined with ``causal`` if both are given.
        enable_gqa: allow ``H_kv`` to divide ``H_q`` (grouped-query attention).
        window: ``(left, right)``: query i sees keys ``i + off - left <= j <= i + off + right`` (``off`` the
            diagonal offset of ``causal_align``; -1: unbounded), as flash-attn's ``window_size``.
        softcap: scores become ``softcap * tanh(score / softcap)`` before any bias or mask (Gemma 2).
        alibi_slopes: ``(H_q,)`` or ``(*batch, H_q)``: ``-slope * |i + off - j|`` added to the scores.
        seqlens_k: integer tensor of the batch shape: keys ``j >= seqlens_k[b]`` are invisible.
            See :mod:`flashattn_teach.masks` for how these compose.
        dropout_p: probability of zeroing an attention weight (applied to ``P``, survivors scaled by
            ``1 / (1 - dropout_p)``), as in torch's SDPA, whenever it is above 0 (there is no training
            flag). The mask comes from the counter-based generator of :mod:`flashattn_teach.dropout`, keyed
            once per call from torch's default generator (``torch.manual_seed`` makes calls repeatable);
            every backend draws the same mask for the same key. Not applied to ``lse``.
        score_mod, mask_mod, block_mask: FlexAttention's user functions (:mod:`flashattn_teach.flex.mods`),
            evaluated here once on the whole ``N_q x N_k`` grid and differentiated by ordinary autograd.
        sinks: attention sinks ``(H_q,)``: one more score column per row, ``sink_h``, in the softmax, dropped
            before ``P V`` (GPT-OSS's eager attention); differentiated by ordinary autograd.
        deterministic: taken as :func:`flashattn_teach.flash_attention` takes it; this path always is.
        return_lse: also return ``lse``.

    Returns:
        ``O`` of shape ``(..., H_q, N_q, D_v)`` in ``q``'s dtype, and with ``return_lse`` also ``lse`` of
        shape ``(..., H_q, N_q)`` in the compute dtype (float64 for float64 inputs, else float32).
        A query row that sees no key gets ``O = 0`` and ``lse = -inf`` (``sink_h`` with sinks).
    """
    q, k, v = cast_inputs(q, k, v)
    opts = make_options(q, k, v, options)
    O, lse = dense_forward(q, k, v, opts.with_dropout())
    return (O, lse) if check_bool("return_lse", return_lse) else O


def dense_forward(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of validated inputs: ``O`` in ``q``'s dtype, ``lse`` in the compute dtype; dropout by the
    key in ``opts`` (drawn by ``opts.with_dropout()``)."""
    s = opts.shapes
    dt = compute_dtype(q.dtype)
    with autocast_off(q.device.type):
        qc, kc, vc = (pad_rank(t, s.rank).to(dt) for t in (q, k, v))
        if s.rank > 2 and s.group > 1 and s.H_kv > 1:
            # GQA: query head h reads key/value head h // G (torch's repeat_interleave convention); a
            # tensor with one head broadcasts instead.
            kc, vc = (t.repeat_interleave(s.group, dim=-3) if t.shape[-3] > 1 else t for t in (kc, vc))

        # Scale Q before the product, as every tiled path does, so that both round alike and a mask never
        # changes whether a score overflows.
        S = torch.matmul(qc * s.scale, kc.transpose(-2, -1))  # (..., N_q, D) @ (..., D, N_k) -> (..., N_q, N_k)
        if opts.mask.softcap is not None:
            S = soft_cap(S, opts.mask.softcap)
        allowed, bias = opts.mask.dense(q.device)  # bool and additive, broadcastable to S (flashattn_teach.masks)
        if bias is not None:
            S = S + bias
        mods = opts.mask.mods
        if mods is not None and mods.score_mod is not None:  # the user's score_mod, on the flat layout's indices
            index = opts.mask.tile_index(0, s.N_q, 0, s.N_k, q.device)
            S = mods.score(opts.mask.scores_to_flat(S), index).reshape(S.shape)
        if allowed is not None:
            S = S.masked_fill(~allowed, float("-inf"))

        if opts.sinks is not None:
            # Attention sinks (GPT-OSS): one more column, sink_h, in every row of head h; softmax over the
            # row with it, then drop it, so the keys' weights sum to 1 - exp(sink_h - lse_i).
            S = torch.cat([S.expand(s.score_shape), _sink_column(opts.sinks, s.score_shape, dt)], dim=-1)

        # Rows with no visible key: softmax over all -inf is NaN, but the defined answer is O = 0, lse = -inf.
        # Give those rows harmless scores, then zero them, so neither value nor gradient becomes NaN.
        empty = torch.isneginf(S).all(dim=-1, keepdim=True)  # (..., N_q, 1)
        S_safe = S.masked_fill(empty, 0.0)
        lse = torch.logsumexp(S_safe, dim=-1)  # (..., N_q)
        P = torch.softmax(S_safe, dim=-1).masked_fill(empty, 0.0)  # (..., N_q, N_k), or N_k + 1 with sinks
        if opts.sinks is not None:
            P = P[..., :-1]  # the sink has no value: its weight reaches no V
        key = opts.dropout
        if key.p > 0.0:
            # Every (batch element, head) draws its own mask: P gets all of the score shape first (q and k may
            # broadcast), and bh = b * H_q + h numbers its heads as the tiled paths do.
            P = P.expand(s.score_shape)
            heads = s.score_shape[:-2]  # (*batch, H_q), or () for 2-D inputs
            bh = torch.arange(math.prod(heads), device=P.device).reshape(*heads, 1, 1)
            rows, cols = torch.arange(s.N_q, device=P.device)[:, None], torch.arange(s.N_k, device=P.device)
            P = drop(P, key, bh, rows, cols, s.N_q, s.N_k)  # (..., N_q, N_k)
        O = torch.matmul(P, vc)  # (..., N_q, N_k) @ (..., N_k, D_v) -> (..., N_q, D_v)
        lse = lse.masked_fill(empty.squeeze(-1), float("-inf"))
    return O.expand(s.out_shape).to(q.dtype), lse.expand(s.lse_shape)


def _sink_column(sinks: Tensor, score_shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """``sinks (H_q,)`` as a column of the scores, ``(*batch, H_q, N_q, 1)`` (a 2-D call's one sink as
    ``(N_q, 1)``), in the compute dtype and differentiable."""
    col = sinks.to(dtype).reshape(-1, 1, 1) if len(score_shape) > 2 else sinks.to(dtype).reshape(1, 1)
    return col.expand(*score_shape[:-1], 1)
