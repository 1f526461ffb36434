"""Changes from core/kernel.py (``_dkdv_inner``): the same ``P^T`` and ``dS^T`` step with the mask contract's
score features and masks, dropout, the atomic dQ partial, and a split head dim.

The dK/dV kernel's loop over query blocks (and the query heads of a group): one step recomputes
``P_ij^T`` and ``dS_ij^T`` for key block ``j`` and adds them into ``dV_j`` and ``dK_j``; in the one-kernel
backward it also adds the step's dQ partial into the fp32 dQ buffer. :mod:`.backward_dkdv` has the kernel.
With ``BLOCK_D2 > 0`` (a head dim of two lane groups, :mod:`.tiles`) ``S_ij^T`` is two MMAs, and ``dK_j``
and the dQ partial two accumulators, one a lane group.
"""

from __future__ import annotations

import triton
from triton import language as tl

from .dropout import _dropout_keep
from .forward import LOG2E
from .masking import LN2, _attn_mask_tile, _in_window, _modify_scores
from .tiles import _load_block, _load_block_hi, _load_block_T, _load_tile_tma
from .trace_backward import _trace_dkdv
from .usermods import KIND_PARTIAL, KIND_SKIP, _mask_mod_visible, _score_mod


@triton.jit
def _attn_bwd_dkdv_inner(
    dk,  # dK_j (BLOCK_N, BLOCK_D) fp32 accumulator
    dk2,  # with BLOCK_D2: dK_j's second lane group (BLOCK_N, BLOCK_D2) fp32, likewise k2; otherwise unread
    dv,  # dV_j (BLOCK_N, BLOCK_DV) fp32 accumulator
    k,  # K_j (BLOCK_N, BLOCK_D)
    k2,
    v,  # V_j (BLOCK_N, BLOCK_DV)
    Q_group,  # Q of the group's first query head (row 0), likewise dO, lse2, delta; with TMA Q's and dO's descriptors
    DO_group,
    Q,  # records.Strided of Q, dO and (with DQ_ATOMIC) the dQ buffer, for their head, row and lane strides
    DO,
    DQ,
    b_coord,  # with TMA: the batch element and the group's first query head, as descriptor coordinates
    h0_coord,
    LSE2_group,
    DELTA_group,
    row_stats,  # records.RowStats, for the head stride of lse2 and delta
    GROUP,
    start_m,
    end_m,
    start_n,
    N_q,
    qk_scale,
    OFFSET,
    bounds,  # records.Bounds: the window's LEFT, RIGHT
    terms,  # records.ScoreTerms: softcap_log2, the ALiBi slopes' and the user's attn_mask's strides
    SLOPES_group,  # ALiBi slope of the group's first query head, or None
    dropout,  # records.Dropout; the counters: offset, the group's first (b * H_q + h), the sizes N_q x N_k
    drop_offset,
    drop_bh0,
    drop_N_q,
    drop_N_k,
    MASK_group,  # the user's attn_mask at the group's first query head, or None
    DQ_group,  # with DQ_ATOMIC: the fp32 dQ buffer at the group's first query head, and the scale
    scale,
    mods,  # records.UserMods: the captured tensors of score_mod and mask_mod, the kinds' strides
    KINDS_col,  # the block mask's kinds of this key block at the group's first query head (its first query
    # tile), or None
    LIST_col,  # with LISTED: variants.tile_list's row of this key block (the query tiles that see it), or None
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    F: tl.constexpr,
    WITH_DK: tl.constexpr,
    WITH_DV: tl.constexpr,
    MASK: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,
    SCORE_GRAD: tl.constexpr = None,
):
    """Accumulate query blocks ``[start_m, end_m)`` of each of the ``GROUP`` query heads into ``dK_j, dV_j``
    (only the one of them named by ``WITH_DK`` / ``WITH_DV`` when the two are computed by separate programs).

    One flat loop over ``GROUP * n_steps`` (head, block) pairs, the block fastest. Works on transposed
    tiles (keys along rows) so that no probability tile needs a transpose. ``MASK`` selects the stage:
    True for the diagonal and the ragged last block, where ``P`` of invisible pairs is 0; False for full
    blocks, whose loads need no row mask. The user's functions (:mod:`.usermods`) see the transposed index
    grids ``q_idx (1, BLOCK_M)``, ``kv_idx (BLOCK_N, 1)``, the flat batch index ``b_coord`` and the query head
    ``h0_coord + g``; a SKIP tile of ``KINDS`` adds nothing. ``LISTED``: ``[start_m, end_m)`` counts
    entries of ``LIST_col``, each ``(i << 2) | kind``, the same for every head of the group (the launcher
    sets it only then).
    """
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    offs_n = start_n + cols
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # an empty stage (end_m <= start_m) has no steps; the divisor is kept >= 1 so that no code the compiler
    # moves out of an empty loop divides by zero
    if F.LISTED:
        n_steps = tl.maximum(end_m - start_m, 0)
    else:
        n_steps = tl.maximum(tl.cdiv(end_m - start_m, BLOCK_M), 0)
    # the masked stages run a block or two per key block; by TMA they run unpipelined, which leaves more
    # registers to the tile (through pointers one stage would hold the loaded tiles in registers instead)
    for t in tl.range(0, GROUP * n_steps, num_stages=1 if MASK and F.TMA and not F.LISTED else None):
        if GROUP == 1:
            g = 0  # the JIT makes GROUP = 1 a constant: no division without grouped-query attention
        else:
            g = t // tl.maximum(n_steps, 1)
        kind = KIND_PARTIAL
        visit = True
        if F.LISTED:
            code = tl.load(LIST_col + 1 + start_m + (t - g * n_steps))  # (i << 2) | kind
            start = (code >> 2) * BLOCK_M
            kind = code & 3
        else:
            start = start_m + (t - g * n_steps) * BLOCK_M
            if F.KINDS:
                kind = tl.load(KINDS_col + g * mods.kinds_stride_h + (start // BLOCK_M) * mods.kinds_stride_m)
                visit = kind != KIND_SKIP
        rows = tl.cast(start, tl.int64)
        stats = tl.cast(g, tl.int64) * row_stats.stride_h + rows
        if visit:  # a SKIP tile of the block mask adds nothing
            in_q = start + offs_m < N_q
            # Q_i^T: (BLOCK_D, BLOCK_M); dO_i: (BLOCK_M, BLOCK_DV)
            if F.TMA:
                # the copy engine fills rows past N_q and lanes past D with zeros; no address arithmetic here
                qT = tl.trans(_load_tile_tma(Q_group, b_coord, h0_coord + g, start, BLOCK_M, BLOCK_D))
                do = _load_tile_tma(DO_group, b_coord, h0_coord + g, start, BLOCK_M, BLOCK_DV)
            else:
                Q_blk = Q_group + tl.cast(g, tl.int64) * Q.stride_h + rows * Q.stride_n
                DO_blk = DO_group + tl.cast(g, tl.int64) * DO.stride_h + rows * DO.stride_n
                qT = _load_block_T(
                    Q_blk, offs_m, offs_d, Q.stride_n, Q.stride_d, in_q, HEAD_DIM, BLOCK_D, ROWS_OK=not MASK
                )
                do = _load_block(
                    DO_blk, offs_m, offs_dv, DO.stride_n, DO.stride_d, in_q, HEAD_DIM_V, BLOCK_DV, ROWS_OK=not MASK
                )
            # lse_i * log2(e) (+inf for a row that saw no key) and delta_i: (BLOCK_M,)
            lse2 = tl.load(LSE2_group + stats + offs_m, mask=in_q, other=0.0)
            delta = tl.load(DELTA_group + stats + offs_m, mask=in_q, other=0.0)
            # S_ij^T = K_j Q_i^T: (BLOCK_N, BLOCK_D) @ (BLOCK_D, BLOCK_M) -> (BLOCK_N, BLOCK_M)
            qkT = tl.dot(k, qT, input_precision=F.DOT_PRECISION)
            if F.BLOCK_D2 > 0:
                # Q_i^T's second lane group (BLOCK_D2, BLOCK_M); S_ij^T += (BLOCK_N, BLOCK_D2) @ (BLOCK_D2, BLOCK_M)
                qT2 = _load_block_hi(
                    Q_blk,
                    offs_m,
                    Q.stride_n,
                    Q.stride_d,
                    in_q,
                    HEAD_DIM,
                    BLOCK_D,
                    F.BLOCK_D2,
                    ROWS_OK=not MASK,
                    TRANS=True,
                )
                qkT = tl.dot(k2, qT2, qkT, input_precision=F.DOT_PRECISION)
            if F.SOFTCAP or F.ALIBI or F.ADD_MASK:
                slope_log2 = 0.0
                if F.ALIBI:
                    slope_log2 = tl.load(SLOPES_group + g * terms.alibi_stride_h) * LOG2E
                # the scores as the forward modified them, in log2 units; tT = tanh(.) of the softcap
                sT, tT = _modify_scores(
                    qkT * qk_scale,
                    start + offs_m[None, :],
                    offs_n[:, None],
                    OFFSET,
                    terms.softcap_log2,
                    slope_log2,
                    F.SOFTCAP,
                    F.ALIBI,
                )
                if F.ADD_MASK:
                    mask_g = MASK_group + g * terms.mask_stride_h
                    biasT = _attn_mask_tile(
                        mask_g, start, start_n, offs_m[None, :], cols[:, None], terms, N_q, drop_N_k
                    )
                    sT = sT + biasT.to(tl.float32) * LOG2E
                if F.SCORE_MOD is not None:
                    sT = sT * LN2  # natural units for the user's function
            elif F.SCORE_MOD is not None:
                sT = qkT * (qk_scale * LN2)  # scale * q.k
            if F.SCORE_MOD is not None:
                q_idx = start + offs_m[None, :]  # (1, BLOCK_M) and (BLOCK_N, 1): the transposed grids
                kv_idx = offs_n[:, None]
                if SCORE_GRAD is not None:  # d score_mod / d score at the score it was given
                    c = mods.score_captures
                    gradT = SCORE_GRAD(sT, b_coord, h0_coord + g, q_idx, kv_idx, c[0], c[1], c[2], c[3])
                sT = _score_mod(sT, b_coord, h0_coord + g, q_idx, kv_idx, mods.score_captures, F.SCORE_MOD)
                # exp2(-inf - lse2) = 0: a score_mod's -inf needs no guard here
                pT = tl.math.exp2(sT * LOG2E - lse2[None, :])
            elif F.SOFTCAP or F.ALIBI or F.ADD_MASK:
                pT = tl.math.exp2(sT - lse2[None, :])
            else:
                # P_ij^T = exp(S_ij^T - lse_i), the scale folded into one FFMA per score
                pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
            if MASK or F.BOOL_MASK or F.MASK_MOD is not None:
                visible = in_q[None, :]
                if F.CAUSAL:
                    visible = visible & (offs_n[:, None] <= start + offs_m[None, :] + OFFSET)
                if F.WINDOW:
                    visible = visible & _in_window(
                        start + offs_m[None, :], offs_n[:, None], OFFSET, bounds.LEFT, bounds.RIGHT
                    )
                if F.BOOL_MASK:
                    mask_g = MASK_group + g * terms.mask_stride_h
                    userT = _attn_mask_tile(
                        mask_g, start, start_n, offs_m[None, :], cols[:, None], terms, N_q, drop_N_k
                    )
                    visible = visible & (userT != 0)
                if F.MASK_MOD is not None:
                    visible = _mask_mod_visible(
                        visible,
                        kind,
                        b_coord,
                        h0_coord + g,
                        start + offs_m[None, :],
                        offs_n[:, None],
                        mods.mask_captures,
                        F.MASK_MOD,
                    )
                pT = tl.where(visible, pT, 0.0)
            if F.DROPOUT:
                # the forward's keep mask Z, drawn again: (BLOCK_M, BLOCK_N) -> (BLOCK_N, BLOCK_M)
                keepT = tl.trans(
                    _dropout_keep(
                        dropout.seed,
                        drop_offset,
                        drop_bh0 + g,
                        start + offs_m,
                        offs_n,
                        drop_N_q,
                        drop_N_k,
                        dropout.threshold,
                    )
                )
                # dV_j += (P_ij * Z / (1 - p))^T dO_i: (BLOCK_N, BLOCK_M) @ (BLOCK_M, BLOCK_DV)
                if WITH_DV:
                    pT_dropped = tl.where(keepT, pT * dropout.keep_scale, 0.0)
                    dv = tl.dot(pT_dropped.to(do.dtype), do, dv, input_precision=F.DOT_PRECISION)
            elif WITH_DV:
                # dV_j += P_ij^T dO_i: (BLOCK_N, BLOCK_M) @ (BLOCK_M, BLOCK_DV); P cast to dO's dtype for the MMA
                dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=F.DOT_PRECISION)
            if WITH_DK:
                # dP_ij^T = V_j dO_i^T: (BLOCK_N, BLOCK_DV) @ (BLOCK_DV, BLOCK_M) -> (BLOCK_N, BLOCK_M), after the dV
                # update so that the scores' and dP's tiles are not live at once
                dpT = tl.dot(v, tl.trans(do), input_precision=F.DOT_PRECISION)
                if F.DROPOUT:
                    # the gradient reaching P: dP_ij * Z / (1 - p); delta = rowsum(dO * O) is rowsum(P * that)
                    dpT = tl.where(keepT, dpT * dropout.keep_scale, 0.0)
                if DQ_ATOMIC:
                    # scale * dS_ij^T = P_ij^T * (scale dP_ij^T - scale delta_i): one FFMA where the plain form has
                    # an FADD, and dK_j and the dQ partial both come out scaled
                    dsT = pT * (dpT * scale - (delta * scale)[None, :])
                else:
                    # dS_ij^T = P_ij^T * (dP_ij^T - delta_i)
                    dsT = pT * (dpT - delta[None, :])
                if SCORE_GRAD is not None:
                    # dS_raw = dS * d score_mod / d score; an additive mask's -inf may reach score_mod, where its
                    # derivative need not be finite: 0 where P is
                    dsT = tl.where(pT == 0.0, 0.0, dsT * gradT) if F.ADD_MASK else dsT * gradT
                if F.SOFTCAP:
                    # d(c tanh(x / c)) / dx = 1 - tanh^2: the gradient reaching the scaled score x
                    dsT = dsT * (1.0 - tT * tT)
                dsT = dsT.to(qT.dtype)
                # dK_j += dS_ij^T Q_i: (BLOCK_N, BLOCK_M) @ (BLOCK_M, BLOCK_D); without DQ_ATOMIC the scale is
                # applied once at the end
                dk = tl.dot(dsT, tl.trans(qT), dk, input_precision=F.DOT_PRECISION)
                if F.BLOCK_D2 > 0:
                    # the second lane group: (BLOCK_N, BLOCK_M) @ (BLOCK_M, BLOCK_D2)
                    dk2 = tl.dot(dsT, tl.trans(qT2), dk2, input_precision=F.DOT_PRECISION)
                if DQ_ATOMIC:
                    # dQ_i += scale dS_ij K_j: (BLOCK_M, BLOCK_N) @ (BLOCK_N, BLOCK_D), added into the fp32 buffer
                    # that every key block's program adds to; K_j's rows past the keys are 0 and add nothing
                    dq = tl.dot(tl.trans(dsT), k, input_precision=F.DOT_PRECISION)
                    DQ_blk = DQ_group + tl.cast(g, tl.int64) * DQ.stride_h + rows * DQ.stride_n
                    ptrs = DQ_blk + offs_m[:, None] * DQ.stride_n + offs_d[None, :] * DQ.stride_d
                    tl.atomic_add(ptrs, dq, mask=in_q[:, None] & (offs_d[None, :] < HEAD_DIM), sem="relaxed")
                    if F.BLOCK_D2 > 0:
                        # lanes [BLOCK_D, BLOCK_D + BLOCK_D2): (BLOCK_M, BLOCK_N) @ (BLOCK_N, BLOCK_D2)
                        dq2 = tl.dot(tl.trans(dsT), k2, input_precision=F.DOT_PRECISION)
                        lanes2 = BLOCK_D + tl.arange(0, F.BLOCK_D2)
                        ptrs2 = DQ_blk + offs_m[:, None] * DQ.stride_n + lanes2[None, :] * DQ.stride_d
                        tl.atomic_add(ptrs2, dq2, mask=in_q[:, None] & (lanes2[None, :] < HEAD_DIM), sem="relaxed")
                if F.TRACE:  # the step's state, after its updates (.trace_backward)
                    dq_traced = None
                    if DQ_ATOMIC:
                        dq_traced = dq
                    i = start // BLOCK_M
                    _trace_dkdv(
                        row_stats.trace, b_coord, h0_coord + g, i, start_n // BLOCK_N, pT, dpT, dsT, dk, dv, dq_traced
                    )
    return dk, dk2, dv
