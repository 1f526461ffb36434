"""Changes from core/kernel.py (``_dq_inner``): the same ``dS K`` step with the mask contract's score features
and masks, dropout, and a split head dim.

The dQ kernel's loop over key blocks: one step recomputes ``P_ij`` and ``dS_ij`` for query block ``i``
and key block ``j`` and adds ``dS_ij K_j`` into ``dQ_i``. :mod:`.backward_dq` has the kernel. With
``BLOCK_D2 > 0`` (a head dim of two lane groups, :mod:`.tiles`) ``S_ij`` is two MMAs and ``dQ_i`` two
accumulators, one a lane group.
"""

from __future__ import annotations

import triton
from triton import language as tl

from .dropout import _dropout_keep
from .forward import LOG2E
from .masking import LN2, _attn_mask_tile, _in_window, _modify_scores
from .tiles import _load_block_hi, _load_block_T, _load_tile_tma
from .trace_backward import _trace_dq
from .usermods import KIND_PARTIAL, KIND_SKIP, _mask_mod_visible, _score_mod


@triton.jit
def _attn_bwd_dq_inner(
    dq,  # dQ_i (BLOCK_M, BLOCK_D) fp32 accumulator
    dq2,  # with BLOCK_D2: dQ_i's second lane group (BLOCK_M, BLOCK_D2) fp32, likewise q2; otherwise unread
    q,  # Q_i (BLOCK_M, BLOCK_D)
    q2,
    do,  # dO_i (BLOCK_M, BLOCK_DV)
    lse2,  # (BLOCK_M,) fp32, lse_i * log2(e)
    delta,  # (BLOCK_M,) fp32, rowsum(dO_i * O_i)
    K_head,  # K and V of the key/value head (row 0); with TMA K's and V's descriptors
    V_head,
    K,  # records.Strided of the keys and values, for their row and lane strides
    V,
    b_coord,  # with TMA: the batch element and the key/value head, as descriptor coordinates
    h_coord,
    start_n,
    end_n,
    start_m,
    N_k,
    qk_scale,
    OFFSET,
    bounds,  # records.Bounds: the window's LEFT, RIGHT
    terms,  # records.ScoreTerms: softcap_log2 and the user's attn_mask's row and column strides
    slope_log2,
    dropout,  # records.Dropout; the counters of this program as in _attn_bwd_dkdv_inner
    drop_offset,
    drop_bh,
    drop_N_q,
    drop_N_k,
    MASK_head,  # the user's attn_mask at (b, h), or None
    b_idx,  # the flat batch index and the query head, as the user's functions see them (int32)
    h_idx,
    mods,  # records.UserMods: the captured tensors of score_mod and mask_mod, the kinds' key-tile stride
    KINDS_row,  # the block mask's kinds of this query block (its first key tile), or None
    LIST_row,  # with LISTED: variants.tile_list's row of this query block, or None
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    F: tl.constexpr,
    MASK: tl.constexpr,
    SCORE_GRAD: tl.constexpr = None,
    Trace=None,
):
    """Accumulate key blocks ``[start_n, end_n)`` into ``dQ_i``; ``MASK`` as in :func:`_attn_bwd_dkdv_inner`,
    the user's functions and the tile kinds as in :func:`~.forward_inner._attn_fwd_inner`."""
    rows = tl.arange(0, BLOCK_M)
    offs_m = start_m + rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for it in tl.range(start_n, end_n, 1 if F.LISTED else BLOCK_N):
        kind = KIND_PARTIAL
        visit = True
        if F.LISTED:  # [start_n, end_n) counts entries of LIST_row, each (j << 2) | kind
            code = tl.load(LIST_row + 1 + it)
            start = (code >> 2) * BLOCK_N
            kind = code & 3
        else:
            start = it
            if F.KINDS:
                kind = tl.load(KINDS_row + (start // BLOCK_N) * mods.kinds_stride_n)
                visit = kind != KIND_SKIP
        if visit:  # a SKIP tile of the block mask adds nothing
            in_k = start + offs_n < N_k
            # K_j^T: (BLOCK_D, BLOCK_N), V_j^T: (BLOCK_DV, BLOCK_N)
            if F.TMA:
                kT = tl.trans(_load_tile_tma(K_head, b_coord, h_coord, start, BLOCK_N, BLOCK_D))
                vT = tl.trans(_load_tile_tma(V_head, b_coord, h_coord, start, BLOCK_N, BLOCK_DV))
            else:
                cols = tl.cast(start, tl.int64)
                kT = _load_block_T(
                    K_head + cols * K.stride_n,
                    offs_n,
                    offs_d,
                    K.stride_n,
                    K.stride_d,
                    in_k,
                    HEAD_DIM,
                    BLOCK_D,
                    ROWS_OK=not MASK,
                )
                vT = _load_block_T(
                    V_head + cols * V.stride_n,
                    offs_n,
                    offs_dv,
                    V.stride_n,
                    V.stride_d,
                    in_k,
                    HEAD_DIM_V,
                    BLOCK_DV,
                    ROWS_OK=not MASK,
                )
            # S_ij = Q_i K_j^T: (BLOCK_M, BLOCK_D) @ (BLOCK_D, BLOCK_N); P_ij = exp(S_ij - lse_i), one FFMA a score
            qk = tl.dot(q, kT, input_precision=F.DOT_PRECISION)
            if F.BLOCK_D2 > 0:
                # K_j^T's second lane group (BLOCK_D2, BLOCK_N); S_ij += (BLOCK_M, BLOCK_D2) @ (BLOCK_D2, BLOCK_N)
                kT2 = _load_block_hi(
                    K_head + cols * K.stride_n,
                    offs_n,
                    K.stride_n,
                    K.stride_d,
                    in_k,
                    HEAD_DIM,
                    BLOCK_D,
                    F.BLOCK_D2,
                    ROWS_OK=not MASK,
                    TRANS=True,
                )
                qk = tl.dot(q2, kT2, qk, input_precision=F.DOT_PRECISION)
            if F.SOFTCAP or F.ALIBI or F.ADD_MASK:
                s, t = _modify_scores(
                    qk * qk_scale,
                    offs_m[:, None],
                    start + offs_n[None, :],
                    OFFSET,
                    terms.softcap_log2,
                    slope_log2,
                    F.SOFTCAP,
                    F.ALIBI,
                )
                if F.ADD_MASK:
                    bias = _attn_mask_tile(
                        MASK_head, start_m, start, rows[:, None], offs_n[None, :], terms, drop_N_q, drop_N_k
                    )
                    s = s + bias.to(tl.float32) * LOG2E
                if F.SCORE_MOD is not None:
                    s = s * LN2  # natural units for the user's function
            elif F.SCORE_MOD is not None:
                s = qk * (qk_scale * LN2)  # scale * q.k
            if F.SCORE_MOD is not None:
                q_idx = offs_m[:, None]
                kv_idx = start + offs_n[None, :]
                if SCORE_GRAD is not None:  # d score_mod / d score at the score it was given
                    c = mods.score_captures
                    grad = SCORE_GRAD(s, b_idx, h_idx, q_idx, kv_idx, c[0], c[1], c[2], c[3])
                s = _score_mod(s, b_idx, h_idx, q_idx, kv_idx, mods.score_captures, F.SCORE_MOD)
                # exp2(-inf - lse2) = 0: a score_mod's -inf needs no guard here
                p = tl.math.exp2(s * LOG2E - lse2[:, None])
            elif F.SOFTCAP or F.ALIBI or F.ADD_MASK:
                p = tl.math.exp2(s - lse2[:, None])
            else:
                p = tl.math.exp2(qk * qk_scale - lse2[:, None])
            if MASK or F.BOOL_MASK or F.MASK_MOD is not None:
                visible = in_k[None, :]
                if F.CAUSAL:
                    visible = visible & (start + offs_n[None, :] <= offs_m[:, None] + OFFSET)
                if F.WINDOW:
                    visible = visible & _in_window(
                        offs_m[:, None], start + offs_n[None, :], OFFSET, bounds.LEFT, bounds.RIGHT
                    )
                if F.BOOL_MASK:
                    user = _attn_mask_tile(
                        MASK_head, start_m, start, rows[:, None], offs_n[None, :], terms, drop_N_q, drop_N_k
                    )
                    visible = visible & (user != 0)
                if F.MASK_MOD is not None:
                    visible = _mask_mod_visible(
                        visible,
                        kind,
                        b_idx,
                        h_idx,
                        offs_m[:, None],
                        start + offs_n[None, :],
                        mods.mask_captures,
                        F.MASK_MOD,
                    )
                p = tl.where(visible, p, 0.0)
            # dP_ij = dO_i V_j^T: (BLOCK_M, BLOCK_DV) @ (BLOCK_DV, BLOCK_N); dS_ij = P_ij * (dP_ij - delta_i)
            dp = tl.dot(do, vT, input_precision=F.DOT_PRECISION)
            if F.DROPOUT:
                # the gradient reaching P through the forward's keep mask: dP_ij * Z / (1 - p)
                keep = _dropout_keep(
                    dropout.seed, drop_offset, drop_bh, offs_m, start + offs_n, drop_N_q, drop_N_k, dropout.threshold
                )
                dp = tl.where(keep, dp * dropout.keep_scale, 0.0)
            ds = p * (dp - delta[:, None])
            if SCORE_GRAD is not None:
                # dS_raw = dS * d score_mod / d score; an additive mask's -inf may reach score_mod, where its
                # derivative need not be finite: 0 where P is
                ds = tl.where(p == 0.0, 0.0, ds * grad) if F.ADD_MASK else ds * grad
            if F.SOFTCAP:
                ds = ds * (1.0 - t * t)  # through the softcap's tanh, as in the dK/dV pass
            # dQ_i += dS_ij K_j: (BLOCK_M, BLOCK_N) @ (BLOCK_N, BLOCK_D); the scale is applied once at the end
            dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=F.DOT_PRECISION)
            if F.BLOCK_D2 > 0:
                # the second lane group: (BLOCK_M, BLOCK_N) @ (BLOCK_N, BLOCK_D2)
                dq2 = tl.dot(ds.to(kT.dtype), tl.trans(kT2), dq2, input_precision=F.DOT_PRECISION)
            if F.TRACE:  # the step's own dS_ij K_j, one more MMA of the trace build, then its state (.trace_backward)
                part = tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision=F.DOT_PRECISION)
                _trace_dq(Trace, b_idx, h_idx, start_m // BLOCK_M, start // BLOCK_N, p, dp, ds.to(kT.dtype), part, dq)
    return dq, dq2
