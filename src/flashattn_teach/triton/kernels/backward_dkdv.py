"""dK and dV of the Triton backward (FlashAttention-2 Alg. 2, the outer loop over key blocks).

A program owns key block ``j`` of one key/value head and walks the query blocks (and, with grouped-query
attention, the ``GROUP`` query heads) that see it, accumulating

    dV_j = sum_i P_ij^T dO_i,    dK_j = scale * sum_i dS_ij^T Q_i,    dS_ij = P_ij * (dO_i V_j^T - delta_i)

with ``P_ij = exp(S_ij - lse_i)`` recomputed from the saved log-sum-exp. :mod:`.backward` has the whole
scheme and the helpers both passes share.
"""

from __future__ import annotations

import triton
from triton import language as tl

from .backward import _causal_query_range
from .dropout import _dropout_keep, _packed_dropout
from .forward import LOG2E
from .masking import _attn_mask_tile, _in_window, _modify_scores, _sequence, _window_query_range
from .tiles import _load_block, _load_block_T, _load_tile_tma, _store_block


@triton.jit
def _attn_bwd_dkdv_inner(
    dk,  # dK_j (BLOCK_N, BLOCK_D) fp32 accumulator
    dv,  # dV_j (BLOCK_N, BLOCK_DV) fp32 accumulator
    k,  # K_j (BLOCK_N, BLOCK_D)
    v,  # V_j (BLOCK_N, BLOCK_DV)
    Q_group,  # Q of the group's first query head (row 0), likewise dO, lse2, delta; with TMA Q's and dO's descriptors
    DO_group,
    b_coord,  # with TMA: the batch element and the group's first query head, as descriptor coordinates
    h0_coord,
    LSE2_group,
    DELTA_group,
    stride_lse_h,  # the head stride of lse2 and delta
    stride_qh,
    stride_qn,
    stride_qd,
    stride_doh,
    stride_don,
    stride_dod,
    GROUP,
    start_m,
    end_m,
    start_n,
    N_q,
    qk_scale,
    OFFSET,
    LEFT,
    RIGHT,
    softcap_log2,
    SLOPES_group,  # ALiBi slope of the group's first query head
    stride_slope_h,
    seed,  # dropout: the key, the group's first (b * H_q + h), the counters' N_q x N_k, threshold, 1 / (1 - p)
    dropout_offset,
    bh0,
    N_q_all,
    N_k,
    dropout_threshold,
    keep_scale,
    MASK_group,  # the user's attn_mask at the group's first query head, and its strides
    stride_mask_h,
    stride_mask_m,
    stride_mask_n,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr,
    BOOL_MASK: tl.constexpr,
    ADD_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WITH_DK: tl.constexpr,
    WITH_DV: tl.constexpr,
    TMA: tl.constexpr,
    MASK: tl.constexpr,
):
    """Accumulate query blocks ``[start_m, end_m)`` of each of the ``GROUP`` query heads into ``dK_j, dV_j``
    (only the one of them named by ``WITH_DK`` / ``WITH_DV`` when the two are computed by separate programs).

    One flat loop over ``GROUP * n_steps`` (head, block) pairs, the block fastest. Works on transposed
    tiles (keys along rows) so that no probability tile needs a transpose. ``MASK`` selects the stage:
    True for the diagonal and the ragged last block, where ``P`` of invisible pairs is 0; False for full
    blocks, whose loads need no row mask.
    """
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    offs_n = start_n + cols
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # an empty stage (end_m <= start_m) has no steps; the divisor is kept >= 1 so that no code the compiler
    # moves out of an empty loop divides by zero
    n_steps = tl.maximum(tl.cdiv(end_m - start_m, BLOCK_M), 0)
    # the masked stages run a block or two per key block; by TMA they run unpipelined, which leaves more
    # registers to the tile (through pointers one stage would hold the loaded tiles in registers instead)
    for t in tl.range(0, GROUP * n_steps, num_stages=1 if MASK and TMA else None):
        if GROUP == 1:
            g = 0  # the JIT makes GROUP = 1 a constant: no division without grouped-query attention
        else:
            g = t // tl.maximum(n_steps, 1)
        start = start_m + (t - g * n_steps) * BLOCK_M
        rows = tl.cast(start, tl.int64)
        stats = tl.cast(g, tl.int64) * stride_lse_h + rows
        in_q = start + offs_m < N_q
        # Q_i^T: (BLOCK_D, BLOCK_M); dO_i: (BLOCK_M, BLOCK_DV)
        if TMA:
            # the copy engine fills rows past N_q and lanes past D with zeros; no address arithmetic here
            qT = tl.trans(_load_tile_tma(Q_group, b_coord, h0_coord + g, start, BLOCK_M, BLOCK_D))
            do = _load_tile_tma(DO_group, b_coord, h0_coord + g, start, BLOCK_M, BLOCK_DV)
        else:
            Q_blk = Q_group + tl.cast(g, tl.int64) * stride_qh + rows * stride_qn
            DO_blk = DO_group + tl.cast(g, tl.int64) * stride_doh + rows * stride_don
            qT = _load_block_T(Q_blk, offs_m, offs_d, stride_qn, stride_qd, in_q, HEAD_DIM, BLOCK_D, ROWS_OK=not MASK)
            do = _load_block(
                DO_blk, offs_m, offs_dv, stride_don, stride_dod, in_q, HEAD_DIM_V, BLOCK_DV, ROWS_OK=not MASK
            )
        # lse_i * log2(e) (+inf for a row that saw no key) and delta_i: (BLOCK_M,)
        lse2 = tl.load(LSE2_group + stats + offs_m, mask=in_q, other=0.0)
        delta = tl.load(DELTA_group + stats + offs_m, mask=in_q, other=0.0)
        # S_ij^T = K_j Q_i^T: (BLOCK_N, BLOCK_D) @ (BLOCK_D, BLOCK_M) -> (BLOCK_N, BLOCK_M)
        qkT = tl.dot(k, qT, input_precision=DOT_PRECISION)
        if SOFTCAP or ALIBI or ADD_MASK:
            slope_log2 = 0.0
            if ALIBI:
                slope_log2 = tl.load(SLOPES_group + g * stride_slope_h) * LOG2E
            # the scores as the forward modified them, in log2 units; tT = tanh(.) of the softcap
            sT, tT = _modify_scores(
                qkT * qk_scale, start + offs_m[None, :], offs_n[:, None], OFFSET, softcap_log2, slope_log2,
                SOFTCAP, ALIBI,
            )  # fmt: skip
            if ADD_MASK:
                biasT = _attn_mask_tile(
                    MASK_group + g * stride_mask_h, start, start_n, offs_m[None, :], cols[:, None],
                    stride_mask_m, stride_mask_n, N_q, N_k,
                )  # fmt: skip
                sT = sT + biasT.to(tl.float32) * LOG2E
            pT = tl.math.exp2(sT - lse2[None, :])
        else:
            # P_ij^T = exp(S_ij^T - lse_i), the scale folded into one FFMA per score
            pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
        if MASK or BOOL_MASK:
            visible = in_q[None, :]
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= start + offs_m[None, :] + OFFSET)
            if WINDOW:
                visible = visible & _in_window(start + offs_m[None, :], offs_n[:, None], OFFSET, LEFT, RIGHT)
            if BOOL_MASK:
                userT = _attn_mask_tile(
                    MASK_group + g * stride_mask_h, start, start_n, offs_m[None, :], cols[:, None],
                    stride_mask_m, stride_mask_n, N_q, N_k,
                )  # fmt: skip
                visible = visible & (userT != 0)
            pT = tl.where(visible, pT, 0.0)
        if DROPOUT:
            # the forward's keep mask Z, drawn again: (BLOCK_M, BLOCK_N) -> (BLOCK_N, BLOCK_M)
            keepT = tl.trans(
                _dropout_keep(seed, dropout_offset, bh0 + g, start + offs_m, offs_n, N_q_all, N_k, dropout_threshold)
            )
            # dV_j += (P_ij * Z / (1 - p))^T dO_i: (BLOCK_N, BLOCK_M) @ (BLOCK_M, BLOCK_DV)
            if WITH_DV:
                pT_dropped = tl.where(keepT, pT * keep_scale, 0.0)
                dv = tl.dot(pT_dropped.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        elif WITH_DV:
            # dV_j += P_ij^T dO_i: (BLOCK_N, BLOCK_M) @ (BLOCK_M, BLOCK_DV); P cast to dO's dtype for the MMA
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        if WITH_DK:
            # dP_ij^T = V_j dO_i^T: (BLOCK_N, BLOCK_DV) @ (BLOCK_DV, BLOCK_M) -> (BLOCK_N, BLOCK_M), after the dV
            # update so that the scores' and dP's tiles are not live at once
            dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            if DROPOUT:
                # the gradient reaching P: dP_ij * Z / (1 - p); delta = rowsum(dO * O) is rowsum(P * that)
                dpT = tl.where(keepT, dpT * keep_scale, 0.0)
            # dS_ij^T = P_ij^T * (dP_ij^T - delta_i)
            dsT = pT * (dpT - delta[None, :])
            if SOFTCAP:
                # d(c tanh(x / c)) / dx = 1 - tanh^2: the gradient reaching the scaled score x
                dsT = dsT * (1.0 - tT * tT)
            # dK_j += dS_ij^T Q_i: (BLOCK_N, BLOCK_M) @ (BLOCK_M, BLOCK_D); the scale is applied once at the end
            dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def attn_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    LSE2,
    DELTA,
    DK,
    DV,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dod,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dkd,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_dvd,
    H_q,
    H_kv,
    N_q,
    N_k,
    GROUP,
    scale,
    qk_scale,
    OFFSET,
    SEQLENS_K,
    ALIBI_SLOPES,
    stride_slope_b,
    stride_slope_h,
    LEFT,
    RIGHT,
    softcap_log2,
    seed,
    dropout_offset,
    dropout_threshold,
    keep_scale,
    ATTN_MASK,
    stride_mask_b,
    stride_mask_h,
    stride_mask_m,
    stride_mask_n,
    CU_SEQLENS_Q,
    CU_SEQLENS_K,
    stride_lse_h,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WITH_DK: tl.constexpr,
    WITH_DV: tl.constexpr,
    WINDOW: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
    ALIBI: tl.constexpr = False,
    SEQLENS: tl.constexpr = False,
    DROPOUT: tl.constexpr = False,
    BOOL_MASK: tl.constexpr = False,
    ADD_MASK: tl.constexpr = False,
    VARLEN: tl.constexpr = False,
    TMA: tl.constexpr = False,
):
    """Grid ``(cdiv(N_k, BLOCK_N) * B * H_kv,)``, the key block fastest. ``DK, DV`` have K's and V's shapes
    ``(B, H_kv, N_k, .)``; query heads ``h_kv * GROUP ... h_kv * GROUP + GROUP - 1`` read key head h_kv.
    Variants as in :func:`~.forward.attn_fwd`; ``qk_scale = scale * log2(e)`` here, with its sign. With
    ``TMA`` ``Q`` and ``DO`` are tensor descriptors of blocks ``(1, 1, BLOCK_M, .)``."""
    tl.static_assert(not (TMA and VARLEN), "packed sequences end inside the tensor, where no TMA box stops")
    n_blocks = tl.cdiv(N_k, BLOCK_N)
    pid = tl.program_id(0)
    bh = pid // n_blocks
    start_n = (pid % n_blocks) * BLOCK_N
    b = (bh // H_kv).to(tl.int64)
    h_kv = (bh % H_kv).to(tl.int64)
    h0 = h_kv * GROUP  # the group's first query head; its GROUP heads are summed here rather than with atomics
    LSE2_group = LSE2 + (b * H_q + h0) * stride_lse_h  # lse2 and delta (B, H_q, N_q) contiguous
    DELTA_group = DELTA + (b * H_q + h0) * stride_lse_h
    drop_offset, drop_bh0, drop_N_q, drop_N_k = dropout_offset, b * H_q + h0, N_q, N_k  # the forward's counters
    if VARLEN:
        # as in the forward: N_q, N_k and OFFSET become the sequence's, the bases move to its start rows
        q_start, k_start, N_q, N_k, OFFSET = _sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, OFFSET)
        if start_n >= N_k:
            return  # a key block past this sequence's end
        if DROPOUT:
            n_seq = tl.num_programs(0) // (n_blocks * H_kv)
            drop_offset, drop_N_q, drop_N_k = _packed_dropout(
                CU_SEQLENS_Q, CU_SEQLENS_K, n_seq, q_start, k_start, dropout_offset
            )
            drop_bh0 = h0
        Q = Q + q_start * stride_qn
        DO = DO + q_start * stride_don
        K = K + k_start * stride_kn
        V = V + k_start * stride_vn
        DK = DK + k_start * stride_dkn
        DV = DV + k_start * stride_dvn
        LSE2_group = LSE2 + h0 * stride_lse_h + q_start  # lse2 and delta (H_q, total_q)
        DELTA_group = DELTA + h0 * stride_lse_h + q_start
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_k = start_n + offs_n < N_k
    cols = start_n.to(tl.int64)
    # K_j: (BLOCK_N, BLOCK_D), V_j: (BLOCK_N, BLOCK_DV), loaded once
    K_blk = K + b * stride_kb + h_kv * stride_kh + cols * stride_kn
    V_blk = V + b * stride_vb + h_kv * stride_vh + cols * stride_vn
    k = _load_block(K_blk, offs_n, offs_d, stride_kn, stride_kd, in_k, HEAD_DIM, BLOCK_D, ROWS_OK=False)
    v = _load_block(V_blk, offs_n, offs_dv, stride_vn, stride_vd, in_k, HEAD_DIM_V, BLOCK_DV, ROWS_OK=False)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    b_coord = bh // H_kv
    h0_coord = (bh % H_kv) * GROUP
    if TMA:
        Q_group = Q
        DO_group = DO
    else:
        Q_group = Q + b * stride_qb + h0 * stride_qh
        DO_group = DO + b * stride_dob + h0 * stride_doh
    SLOPES_group = ALIBI_SLOPES + b * stride_slope_b + h0 * stride_slope_h
    MASK_group = ATTN_MASK + b * stride_mask_b + h0 * stride_mask_h
    if SEQLENS:
        # OFFSET is the alignment (1: bottom-right, 0: top-left): off_b = seqlens_k[b] - N_q, flash-attn's
        OFFSET = OFFSET * (tl.minimum(tl.load(SEQLENS_K + b), N_k) - N_q)
    if WINDOW:
        begin, diag_end, full_end, end = _window_query_range(start_n, N_q, OFFSET, LEFT, RIGHT, BLOCK_M, BLOCK_N)
    else:
        begin, diag_end, full_end = _causal_query_range(start_n, N_q, OFFSET, BLOCK_M, BLOCK_N, CAUSAL)
        end = N_q
    if SEQLENS:
        # a key block past this batch element's length is seen by no row: no stage runs, dK_j = dV_j = 0
        end = tl.where(start_n < tl.load(SEQLENS_K + b), end, begin)
        diag_end = tl.minimum(diag_end, end)
        full_end = tl.minimum(full_end, end)
    # (start_m, end_m, MASK) of the three stages: the diagonal (the window's right side), the full blocks, the
    # ragged last block (and the window's left side)
    dk, dv = _attn_bwd_dkdv_inner(
        dk, dv, k, v, Q_group, DO_group, b_coord, h0_coord, LSE2_group, DELTA_group, stride_lse_h,
        stride_qh, stride_qn, stride_qd, stride_doh, stride_don, stride_dod, GROUP,
        begin, diag_end, start_n, N_q, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, SLOPES_group, stride_slope_h,
        seed, drop_offset, drop_bh0, drop_N_q, drop_N_k, dropout_threshold, keep_scale,
        MASK_group, stride_mask_h, stride_mask_m, stride_mask_n,
        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
        BOOL_MASK, ADD_MASK, DOT_PRECISION,
        WITH_DK, WITH_DV, TMA=TMA, MASK=True,
    )  # fmt: skip
    dk, dv = _attn_bwd_dkdv_inner(
        dk, dv, k, v, Q_group, DO_group, b_coord, h0_coord, LSE2_group, DELTA_group, stride_lse_h,
        stride_qh, stride_qn, stride_qd, stride_doh, stride_don, stride_dod, GROUP,
        diag_end, full_end, start_n, N_q, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, SLOPES_group, stride_slope_h,
        seed, drop_offset, drop_bh0, drop_N_q, drop_N_k, dropout_threshold, keep_scale,
        MASK_group, stride_mask_h, stride_mask_m, stride_mask_n,
        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
        BOOL_MASK, ADD_MASK, DOT_PRECISION,
        WITH_DK, WITH_DV, TMA=TMA, MASK=False,
    )  # fmt: skip
    dk, dv = _attn_bwd_dkdv_inner(
        dk, dv, k, v, Q_group, DO_group, b_coord, h0_coord, LSE2_group, DELTA_group, stride_lse_h,
        stride_qh, stride_qn, stride_qd, stride_doh, stride_don, stride_dod, GROUP,
        full_end, end, start_n, N_q, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, SLOPES_group, stride_slope_h,
        seed, drop_offset, drop_bh0, drop_N_q, drop_N_k, dropout_threshold, keep_scale,
        MASK_group, stride_mask_h, stride_mask_m, stride_mask_n,
        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
        BOOL_MASK, ADD_MASK, DOT_PRECISION,
        WITH_DK, WITH_DV, TMA=TMA, MASK=True,
    )  # fmt: skip
    if SEQLENS:
        # keys past the length were summed like visible ones (a key's row of dK, dV depends on that key
        # alone), and no row sees them: their gradient is 0
        seen = start_n + offs_n < tl.load(SEQLENS_K + b)
        dk = tl.where(seen[:, None], dk, 0.0)
        dv = tl.where(seen[:, None], dv, 0.0)

    # each output pointer is formed just before its store: one fewer 64-bit register live at the peak
    if WITH_DK:
        # dK_j = scale * sum_i dS_ij^T Q_i
        dk = dk * scale
        DK_blk = DK + b * stride_dkb + h_kv * stride_dkh + cols * stride_dkn
        _store_block(DK_blk, dk.to(DK.dtype.element_ty), offs_n, offs_d, stride_dkn, stride_dkd, in_k, HEAD_DIM)
    if WITH_DV:
        DV_blk = DV + b * stride_dvb + h_kv * stride_dvh + cols * stride_dvn
        _store_block(DV_blk, dv.to(DV.dtype.element_ty), offs_n, offs_dv, stride_dvn, stride_dvd, in_k, HEAD_DIM_V)
