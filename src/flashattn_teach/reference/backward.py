"""Changes from core/backward.py: the same ``tile_terms`` per tile, in the grouped layout (``dK, dV`` summed over
the query heads of a group); the mask contract's tiles; softcap, bias and ``score_mod`` through the
``scores`` hook (``reference/scores.py``), dropout through ``drop``; a gradient into ``lse`` (``dlse``).

Memory-efficient backward: recompute the probabilities tile by tile from the saved ``lse``.

FlashAttention-2's backward (Dao 2023, Alg. 2). Forward saved only ``q, k, v, O`` and
``lse = m + log l``; the ``N_q x N_k`` matrix ``P`` is never stored but rebuilt one tile at a time:

    delta_i = rowsum(dO_i * O_i)                      (Alg. 2 line 4; the "preprocess")
    P_ij    = exp(S_ij - lse_i)                       recompute, S_ij = scale * Q_i K_j^T
    dV_j   += P_ij^T dO_i
    dP_ij   = dO_i V_j^T
    dS_ij   = P_ij * (dP_ij - delta_i)                softmax backward, with delta in place of rowsum(P*dP)
    dK_j   += scale * dS_ij^T Q_i
    dQ_i   += scale * dS_ij K_j

The outer loop is over key blocks ``j`` (``dK_j, dV_j`` accumulate on chip), the inner over query blocks.
A gradient flowing into ``lse`` itself adds ``dlse_i * P_ij`` to ``dS_ij``, i.e. ``delta_i -= dlse_i``.

The tiles visited and their masks and biases are the forward's (:mod:`flashattn_teach.masks`): SKIP tiles contribute
nothing and are left out. A bias (ALiBi, an additive mask) does not depend on ``q, k``, so it changes
``P_ij`` but not the chain rule; a softcap does: with ``T_ij = tanh(scale Q_i K_j^T / softcap)`` the
capped score is ``softcap * T_ij`` and

    dS_ij  *= 1 - T_ij^2                              d(softcap * tanh(x / softcap))/dx

With dropout the forward's keep mask ``Z`` is drawn again from the saved key, tile by tile, not stored
(Dao et al. 2022, Alg. 4; ``tile_dropout.py``): ``P_ij`` becomes ``P_ij * Z s`` in ``dV_j`` and ``dP_ij``
becomes ``dP_ij * Z s`` in ``dS_ij``, with ``s = 1 / (1 - p)``; ``delta_i`` and ``lse`` are unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._layout import grad_to_input, rows_to_grouped, to_grouped
from .._options import make_options
from .._validate.inputs import shape_str, validate_block_sizes
from ..core.backward import tile_terms
from ..dropout import DropoutKey
from ..errors import AttentionTypeError, AttentionValueError
from ..flex.mods import CaptureGrads
from ..masks.spec import Tiling
from .defaults import DEFAULT_BLOCK_M, DEFAULT_BLOCK_N
from .scores import score_hook
from .tile_dropout import NO_DROPOUT, grouped_heads, tile_dropout


def backward_grouped(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    O: Tensor,
    lse: Tensor,
    dO: Tensor,
    dlse: Tensor | None,
    *,
    scale: float,
    tiling: Tiling,
    dropout: DropoutKey = NO_DROPOUT,
    grads: CaptureGrads | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Grouped layout (see ``_layout.py``): ``q, O, dO (B, H_kv, G, N_q, .)``, ``lse (B, H_kv, G, N_q)``,
    ``k, v (B, H_kv, 1, N_k, .)``. Returns ``dq, dk, dv`` in the same layout; ``dk, dv`` are summed over
    the ``G`` query heads that share a key/value head. ``dropout`` is the forward's key; ``grads`` collects
    the gradients of the tensors a ``score_mod`` captures (:mod:`flashattn_teach.flex.mods`)."""
    softcap = tiling.spec.softcap
    has_score_mod = tiling.spec.mods is not None and tiling.spec.mods.score_mod is not None
    N_q, N_k = q.shape[-2], k.shape[-2]
    bh = grouped_heads(q)  # (B, H_kv, G, 1, 1): b * H_q + h, the dropout's head index
    delta = (dO * O).sum(dim=-1)  # (B, H_kv, G, N_q)
    if dlse is not None:
        delta = delta - dlse
    row_blocks = tiling.row_blocks
    # Gradients are collected per block and concatenated (no in-place writes), so that torch.func.vmap can
    # run this backward, as jacrev does.
    dq_blocks = [torch.zeros_like(q[..., r0:r1, :]) for r0, r1 in row_blocks]
    dk_blocks, dv_blocks = [torch.zeros_like(k[..., :0, :])], [torch.zeros_like(v[..., :0, :])]
    for j, (c0, c1) in enumerate(tiling.col_blocks):  # key block j
        k_j, v_j = k[..., c0:c1, :], v[..., c0:c1, :]  # (B, H_kv, 1, Bc, D), (B, H_kv, 1, Bc, D_v)
        dk_j, dv_j = torch.zeros_like(k_j), torch.zeros_like(v_j)  # accumulate "on chip" over query blocks
        for i in tiling.query_blocks(j):  # query block i; SKIP tiles left out
            r0, r1 = row_blocks[i]
            q_i, dO_i = q[..., r0:r1, :], dO[..., r0:r1, :]
            allowed, bias = tiling.tile(i, j, q.device)
            mod = (lambda S, i=i, j=j: tiling.score_backward(i, j, S, grads)) if has_score_mod else None
            drop = tile_dropout(dropout, bh, (r0, r1), (c0, c1), N_q, N_k, q.device)  # the forward's mask
            t = tile_terms(
                q_i,
                k_j,
                v_j,
                dO_i,
                lse[..., r0:r1],
                delta[..., r0:r1],
                scale,
                allowed,
                scores=score_hook(softcap, bias, mod),
                drop=drop,
            )
            dv_j = dv_j + t.dV.sum(dim=2, keepdim=True)  # (B, H_kv, G, Bc, D_v) summed over the G query heads
            dk_j = dk_j + t.dK.sum(dim=2, keepdim=True)  # (B, H_kv, 1, Bc, D)
            dq_blocks[i] = dq_blocks[i] + t.dQ  # (B, H_kv, G, Br, D)
        dk_blocks.append(dk_j)
        dv_blocks.append(dv_j)
    dq = torch.cat([torch.zeros_like(q[..., :0, :]), *dq_blocks], dim=-2)
    return dq, torch.cat(dk_blocks, dim=-2), torch.cat(dv_blocks, dim=-2)


def _check_saved(name: str, t: object, shape: tuple[int, ...]) -> None:
    """``o``, ``do``, ``lse`` and ``dlse`` are floating-point tensors of the forward's output shapes."""
    if not isinstance(t, Tensor) or not t.is_floating_point():
        what = f"{t.dtype} tensor" if isinstance(t, Tensor) else type(t).__name__
        raise AttentionTypeError(f"{name} must be a floating-point torch.Tensor of shape {shape}, got {what}")
    if tuple(t.shape) != shape:
        raise AttentionValueError(f"{name} must have shape {shape}, got {shape_str(t)}")


def flash_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    do: Tensor,
    *,
    dlse: Tensor | None = None,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    enable_gqa: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    seqlens_k: Tensor | None = None,
    attn_mask: Tensor | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of attention from ``q, k, v``, the forward's ``o`` and ``lse``, and ``do = dL/dO``.

    Shapes as :func:`flashattn_teach.reference.dense_attention`: ``q, o, do (..., H_q, N_q, .)``,
    ``lse (..., H_q, N_q)``, ``k, v (..., H_kv, N_k, .)``. Returns ``(dq, dk, dv)`` shaped and typed like
    ``q, k, v``. Holds at most ``block_m x block_n`` probabilities per (batch, head) at once. The mask
    options are the forward's (see :mod:`flashattn_teach.masks`); no gradient flows to them.
    """
    opts = make_options(
        q,
        k,
        v,
        causal=causal,
        causal_align=causal_align,
        scale=scale,
        enable_gqa=enable_gqa,
        attn_mask=attn_mask,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        seqlens_k=seqlens_k,
    )
    s = opts.shapes
    block_m, block_n = validate_block_sizes(block_m, block_n)
    for name, t, shape in (("o", o, s.out_shape), ("do", do, s.out_shape), ("lse", lse, s.lse_shape)):
        _check_saved(name, t, shape)
    if dlse is not None:
        _check_saved("dlse", dlse, s.lse_shape)
    qg, kg, vg = to_grouped(q, k, v, s)
    dt = qg.dtype
    og, dog, lseg = (rows_to_grouped(t, s, dt) for t in (o, do, lse))
    dlseg = None if dlse is None else rows_to_grouped(dlse, s, dt)
    dq, dk, dv = backward_grouped(
        qg,
        kg,
        vg,
        og,
        lseg,
        dog,
        dlseg,
        scale=s.scale,
        tiling=opts.mask.tiling(block_m, block_n),
    )
    return grad_to_input(dq, q, s), grad_to_input(dk, k, s), grad_to_input(dv, v, s)
