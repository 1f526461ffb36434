"""dQ of the Triton backward (FlashAttention-2 Alg. 2, the pass over query blocks).

A program owns query block ``i`` of one query head and walks the key blocks it sees, accumulating
``dQ_i = scale * sum_j dS_ij K_j`` with ``dS_ij = P_ij * (dO_i V_j^T - delta_i)`` and ``P_ij`` recomputed
from the saved log-sum-exp. :mod:`.backward` has the whole scheme and the helpers both passes share.
"""

from __future__ import annotations

import triton
from triton import language as tl

from .dropout import _dropout_keep, _packed_dropout
from .forward import LOG2E, _causal_key_range
from .grid import INDEX, LONGEST, program_block
from .masking import LN2, _attn_mask_tile, _in_window, _modify_scores, _sequence, _window_key_range
from .tiles import _load_block, _load_block_T, _load_tile_tma, _store_block
from .usermods import KIND_PARTIAL, KIND_SKIP, _mask_mod_visible, _score_mod


@triton.jit
def _attn_bwd_dq_inner(
    dq,  # dQ_i (BLOCK_M, BLOCK_D) fp32 accumulator
    q,  # Q_i (BLOCK_M, BLOCK_D)
    do,  # dO_i (BLOCK_M, BLOCK_DV)
    lse2,  # (BLOCK_M,) fp32, lse_i * log2(e)
    delta,  # (BLOCK_M,) fp32, rowsum(dO_i * O_i)
    K_head,  # K and V of the key/value head (row 0); with TMA K's and V's descriptors
    V_head,
    b_coord,  # with TMA: the batch element and the key/value head, as descriptor coordinates
    h_coord,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    start_n,
    end_n,
    start_m,
    N_k,
    qk_scale,
    OFFSET,
    LEFT,
    RIGHT,
    softcap_log2,
    slope_log2,
    seed,  # dropout, as in _attn_bwd_dkdv_inner (bh: this program's b * H_q + h)
    dropout_offset,
    bh,
    N_q,
    N_k_all,
    dropout_threshold,
    keep_scale,
    MASK_head,  # the user's attn_mask at (b, h), and its row and column strides
    stride_mask_m,
    stride_mask_n,
    b_idx,  # the flat batch index and the query head, as the user's functions see them (int32)
    h_idx,
    C0,  # score_mod's captured tensors, then mask_mod's (placeholders when unused)
    C1,
    C2,
    C3,
    MC0,
    MC1,
    MC2,
    MC3,
    KINDS_row,  # the block mask's kinds of this query block (its first key tile), and their key-tile stride
    stride_kind_n,
    LIST_row,  # with LISTED: variants.tile_list's row of this query block
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
    TMA: tl.constexpr,
    MASK: tl.constexpr,
    SCORE_MOD: tl.constexpr = None,
    SCORE_GRAD: tl.constexpr = None,
    MASK_MOD: tl.constexpr = None,
    KINDS: tl.constexpr = False,
    LISTED: tl.constexpr = False,
):
    """Accumulate key blocks ``[start_n, end_n)`` into ``dQ_i``; ``MASK`` as in :func:`_attn_bwd_dkdv_inner`,
    the user's functions and the tile kinds as in :func:`~.forward_inner._attn_fwd_inner`."""
    rows = tl.arange(0, BLOCK_M)
    offs_m = start_m + rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for it in tl.range(start_n, end_n, 1 if LISTED else BLOCK_N):
        kind = KIND_PARTIAL
        visit = True
        if LISTED:  # [start_n, end_n) counts entries of LIST_row, each (j << 2) | kind
            code = tl.load(LIST_row + 1 + it)
            start = (code >> 2) * BLOCK_N
            kind = code & 3
        else:
            start = it
            if KINDS:
                kind = tl.load(KINDS_row + (start // BLOCK_N) * stride_kind_n)
                visit = kind != KIND_SKIP
        if visit:  # a SKIP tile of the block mask adds nothing
            in_k = start + offs_n < N_k
            # K_j^T: (BLOCK_D, BLOCK_N), V_j^T: (BLOCK_DV, BLOCK_N)
            if TMA:
                kT = tl.trans(_load_tile_tma(K_head, b_coord, h_coord, start, BLOCK_N, BLOCK_D))
                vT = tl.trans(_load_tile_tma(V_head, b_coord, h_coord, start, BLOCK_N, BLOCK_DV))
            else:
                cols = tl.cast(start, tl.int64)
                kT = _load_block_T(
                    K_head + cols * stride_kn, offs_n, offs_d, stride_kn, stride_kd, in_k, HEAD_DIM, BLOCK_D,
                    ROWS_OK=not MASK,
                )  # fmt: skip
                vT = _load_block_T(
                    V_head + cols * stride_vn, offs_n, offs_dv, stride_vn, stride_vd, in_k, HEAD_DIM_V, BLOCK_DV,
                    ROWS_OK=not MASK,
                )  # fmt: skip
            # S_ij = Q_i K_j^T: (BLOCK_M, BLOCK_D) @ (BLOCK_D, BLOCK_N); P_ij = exp(S_ij - lse_i), one FFMA a score
            qk = tl.dot(q, kT, input_precision=DOT_PRECISION)
            if SOFTCAP or ALIBI or ADD_MASK:
                s, t = _modify_scores(
                    qk * qk_scale, offs_m[:, None], start + offs_n[None, :], OFFSET, softcap_log2, slope_log2,
                    SOFTCAP, ALIBI,
                )  # fmt: skip
                if ADD_MASK:
                    bias = _attn_mask_tile(
                        MASK_head,
                        start_m,
                        start,
                        rows[:, None],
                        offs_n[None, :],
                        stride_mask_m,
                        stride_mask_n,
                        N_q,
                        N_k_all,
                    )
                    s = s + bias.to(tl.float32) * LOG2E
                if SCORE_MOD is not None:
                    s = s * LN2  # natural units for the user's function
            elif SCORE_MOD is not None:
                s = qk * (qk_scale * LN2)  # scale * q.k
            if SCORE_MOD is not None:
                q_idx = offs_m[:, None]
                kv_idx = start + offs_n[None, :]
                if SCORE_GRAD is not None:  # d score_mod / d score at the score it was given
                    grad = SCORE_GRAD(s, b_idx, h_idx, q_idx, kv_idx, C0, C1, C2, C3)
                s = _score_mod(s, b_idx, h_idx, q_idx, kv_idx, C0, C1, C2, C3, SCORE_MOD)
                # exp2(-inf - lse2) = 0: a score_mod's -inf needs no guard here
                p = tl.math.exp2(s * LOG2E - lse2[:, None])
            elif SOFTCAP or ALIBI or ADD_MASK:
                p = tl.math.exp2(s - lse2[:, None])
            else:
                p = tl.math.exp2(qk * qk_scale - lse2[:, None])
            if MASK or BOOL_MASK or MASK_MOD is not None:
                visible = in_k[None, :]
                if CAUSAL:
                    visible = visible & (start + offs_n[None, :] <= offs_m[:, None] + OFFSET)
                if WINDOW:
                    visible = visible & _in_window(offs_m[:, None], start + offs_n[None, :], OFFSET, LEFT, RIGHT)
                if BOOL_MASK:
                    user = _attn_mask_tile(
                        MASK_head,
                        start_m,
                        start,
                        rows[:, None],
                        offs_n[None, :],
                        stride_mask_m,
                        stride_mask_n,
                        N_q,
                        N_k_all,
                    )
                    visible = visible & (user != 0)
                if MASK_MOD is not None:
                    visible = _mask_mod_visible(
                        visible, kind, b_idx, h_idx, offs_m[:, None], start + offs_n[None, :], MC0, MC1, MC2, MC3,
                        MASK_MOD,
                    )  # fmt: skip
                p = tl.where(visible, p, 0.0)
            # dP_ij = dO_i V_j^T: (BLOCK_M, BLOCK_DV) @ (BLOCK_DV, BLOCK_N); dS_ij = P_ij * (dP_ij - delta_i)
            dp = tl.dot(do, vT, input_precision=DOT_PRECISION)
            if DROPOUT:
                # the gradient reaching P through the forward's keep mask: dP_ij * Z / (1 - p)
                keep = _dropout_keep(seed, dropout_offset, bh, offs_m, start + offs_n, N_q, N_k_all, dropout_threshold)
                dp = tl.where(keep, dp * keep_scale, 0.0)
            ds = p * (dp - delta[:, None])
            if SCORE_GRAD is not None:
                # dS_raw = dS * d score_mod / d score; an additive mask's -inf may reach score_mod, where its
                # derivative need not be finite: 0 where P is
                ds = tl.where(p == 0.0, 0.0, ds * grad) if ADD_MASK else ds * grad
            if SOFTCAP:
                ds = ds * (1.0 - t * t)  # through the softcap's tanh, as in the dK/dV pass
            # dQ_i += dS_ij K_j: (BLOCK_M, BLOCK_N) @ (BLOCK_N, BLOCK_D); the scale is applied once at the end
            dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def attn_bwd_dq(
    Q,
    K,
    V,
    DO,
    LSE2,
    DELTA,
    DQ,
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
    stride_dqb,
    stride_dqh,
    stride_dqn,
    stride_dqd,
    H_q,
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
    C0,
    C1,
    C2,
    C3,
    MC0,
    MC1,
    MC2,
    MC3,
    TILE_KINDS,
    stride_kind_b,
    stride_kind_h,
    stride_kind_m,
    stride_kind_n,
    TILE_LIST,
    stride_list_b,
    stride_list_h,
    stride_list_m,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
    ALIBI: tl.constexpr = False,
    SEQLENS: tl.constexpr = False,
    DROPOUT: tl.constexpr = False,
    BOOL_MASK: tl.constexpr = False,
    ADD_MASK: tl.constexpr = False,
    VARLEN: tl.constexpr = False,
    TMA: tl.constexpr = False,
    SCORE_MOD: tl.constexpr = None,
    SCORE_GRAD: tl.constexpr = None,
    MASK_MOD: tl.constexpr = None,
    KINDS: tl.constexpr = False,
    LISTED: tl.constexpr = False,
):
    """Grid ``(cdiv(N_q, BLOCK_M) * B * H_q,)``, the query block fastest; causal runs the last (longest)
    query blocks first. ``DQ`` has Q's shape ``(B, H_q, N_q, D)``. With ``TMA`` ``K`` and ``V`` are tensor
    descriptors of blocks ``(1, 1, BLOCK_N, .)``. ``SCORE_MOD``, ``SCORE_GRAD`` (its derivative; None when
    it is 1), ``MASK_MOD``, ``KINDS`` and ``LISTED`` as in :func:`~.forward.attn_fwd`, at this launch's tiles."""
    tl.static_assert(not (TMA and VARLEN), "packed sequences end inside the tensor, where no TMA box stops")
    n_blocks = tl.cdiv(N_q, BLOCK_M)
    # causal: the last query blocks see the most keys; all heads' start first (.grid)
    blk, bh = program_block(
        tl.program_id(0), n_blocks, tl.num_programs(0) // n_blocks, N_k,
        ORDER=LONGEST if CAUSAL else INDEX, LONGEST_LAST=True, ROW_BYTES=2 * (HEAD_DIM + HEAD_DIM_V),
    )  # fmt: skip
    start_m = blk * BLOCK_M
    b = (bh // H_q).to(tl.int64)
    h = (bh % H_q).to(tl.int64)
    h_kv = h // GROUP
    b_coord = bh // H_q  # 32-bit descriptor coordinates
    h_coord = (bh % H_q) // GROUP
    stats = bh.to(tl.int64) * stride_lse_h + start_m  # lse2 and delta are (B, H_q, N_q) contiguous
    drop_offset, drop_bh, drop_N_q, drop_N_k = dropout_offset, bh, N_q, N_k  # the forward's dropout counters
    if VARLEN:
        # as in the forward: N_q, N_k and OFFSET become the sequence's, the bases move to its start rows
        q_start, k_start, N_q, N_k, OFFSET = _sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, OFFSET)
        if start_m >= N_q:
            return  # a query block past this sequence's end
        if DROPOUT:
            n_seq = tl.num_programs(0) // (n_blocks * H_q)
            drop_offset, drop_N_q, drop_N_k = _packed_dropout(
                CU_SEQLENS_Q, CU_SEQLENS_K, n_seq, q_start, k_start, dropout_offset
            )
            drop_bh = h
        Q = Q + q_start * stride_qn
        DO = DO + q_start * stride_don
        DQ = DQ + q_start * stride_dqn
        K = K + k_start * stride_kn
        V = V + k_start * stride_vn
        stats = h * stride_lse_h + q_start + start_m  # lse2 and delta (H_q, total_q)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_q = start_m + offs_m < N_q
    rows = start_m.to(tl.int64)
    Q_blk = Q + b * stride_qb + h * stride_qh + rows * stride_qn
    DO_blk = DO + b * stride_dob + h * stride_doh + rows * stride_don
    if TMA:
        K_head = K
        V_head = V
    else:
        K_head = K + b * stride_kb + h_kv * stride_kh
        V_head = V + b * stride_vb + h_kv * stride_vh
    # Q_i: (BLOCK_M, BLOCK_D), dO_i: (BLOCK_M, BLOCK_DV) and the row statistics, loaded once
    q = _load_block(Q_blk, offs_m, offs_d, stride_qn, stride_qd, in_q, HEAD_DIM, BLOCK_D, ROWS_OK=False)
    do = _load_block(DO_blk, offs_m, offs_dv, stride_don, stride_dod, in_q, HEAD_DIM_V, BLOCK_DV, ROWS_OK=False)
    lse2 = tl.load(LSE2 + stats + offs_m, mask=in_q, other=0.0)  # lse_i * log2(e), +inf for no key
    delta = tl.load(DELTA + stats + offs_m, mask=in_q, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    MASK_head = ATTN_MASK + b * stride_mask_b + h * stride_mask_h
    KINDS_row = TILE_KINDS + b * stride_kind_b + h * stride_kind_h + blk * stride_kind_m  # read only with KINDS
    LIST_row = TILE_LIST + b * stride_list_b + h * stride_list_h + blk * stride_list_m  # read only with LISTED
    n_keys = N_k  # the keys that exist for this batch element
    if SEQLENS:
        n_keys = tl.minimum(tl.load(SEQLENS_K + b), N_k)  # keys past this batch element's length are invisible
        # OFFSET is the alignment (1: bottom-right, 0: top-left): off_b = seqlens_k[b] - N_q, flash-attn's
        OFFSET = OFFSET * (n_keys - N_q)
    if ALIBI:
        slope_log2 = tl.load(ALIBI_SLOPES + b * stride_slope_b + h * stride_slope_h) * LOG2E
    else:
        slope_log2 = 0.0
    # (start_n, end_n, MASK) of the stages: the window's left side, the full key blocks, then the diagonal
    # (the window's right side) and the ragged last block
    if LISTED:
        # the block mask's visited tiles, all masked (the causal, window and length bounds still apply)
        dq = _attn_bwd_dq_inner(
            dq, q, do, lse2, delta, K_head, V_head, b_coord, h_coord, stride_kn, stride_kd, stride_vn, stride_vd,
            0, tl.load(LIST_row), start_m, n_keys, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, slope_log2,
            seed, drop_offset, drop_bh, drop_N_q, drop_N_k, dropout_threshold, keep_scale,
            MASK_head, stride_mask_m, stride_mask_n,
            b_coord, bh % H_q, C0, C1, C2, C3, MC0, MC1, MC2, MC3, KINDS_row, stride_kind_n, LIST_row,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
            BOOL_MASK, ADD_MASK, DOT_PRECISION, TMA=TMA,
            SCORE_MOD=SCORE_MOD, SCORE_GRAD=SCORE_GRAD, MASK_MOD=MASK_MOD, KINDS=KINDS, LISTED=True,
            MASK=True,
        )  # fmt: skip
    else:
        if WINDOW:
            begin, full_begin, full_end, end = _window_key_range(start_m, n_keys, OFFSET, LEFT, RIGHT, BLOCK_M, BLOCK_N)
            dq = _attn_bwd_dq_inner(
                dq, q, do, lse2, delta, K_head, V_head, b_coord, h_coord, stride_kn, stride_kd, stride_vn, stride_vd,
                begin, full_begin, start_m, n_keys, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, slope_log2,
                seed, drop_offset, drop_bh, drop_N_q, drop_N_k, dropout_threshold, keep_scale,
                MASK_head, stride_mask_m, stride_mask_n,
                b_coord, bh % H_q, C0, C1, C2, C3, MC0, MC1, MC2, MC3, KINDS_row, stride_kind_n, LIST_row,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
                BOOL_MASK, ADD_MASK, DOT_PRECISION, TMA=TMA,
                SCORE_MOD=SCORE_MOD, SCORE_GRAD=SCORE_GRAD, MASK_MOD=MASK_MOD, KINDS=KINDS,
                MASK=True,
            )  # fmt: skip
        else:
            full_begin = 0
            full_end, end = _causal_key_range(start_m, n_keys, OFFSET, BLOCK_M, BLOCK_N, CAUSAL)
        dq = _attn_bwd_dq_inner(
            dq, q, do, lse2, delta, K_head, V_head, b_coord, h_coord, stride_kn, stride_kd, stride_vn, stride_vd,
            full_begin, full_end, start_m, n_keys, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, slope_log2,
            seed, drop_offset, drop_bh, drop_N_q, drop_N_k, dropout_threshold, keep_scale,
            MASK_head, stride_mask_m, stride_mask_n,
            b_coord, bh % H_q, C0, C1, C2, C3, MC0, MC1, MC2, MC3, KINDS_row, stride_kind_n, LIST_row,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
            BOOL_MASK, ADD_MASK, DOT_PRECISION, TMA=TMA,
            SCORE_MOD=SCORE_MOD, SCORE_GRAD=SCORE_GRAD, MASK_MOD=MASK_MOD, KINDS=KINDS,
            MASK=False,
        )  # fmt: skip
        dq = _attn_bwd_dq_inner(
            dq, q, do, lse2, delta, K_head, V_head, b_coord, h_coord, stride_kn, stride_kd, stride_vn, stride_vd,
            full_end, end, start_m, n_keys, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, slope_log2,
            seed, drop_offset, drop_bh, drop_N_q, drop_N_k, dropout_threshold, keep_scale,
            MASK_head, stride_mask_m, stride_mask_n,
            b_coord, bh % H_q, C0, C1, C2, C3, MC0, MC1, MC2, MC3, KINDS_row, stride_kind_n, LIST_row,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
            BOOL_MASK, ADD_MASK, DOT_PRECISION, TMA=TMA,
            SCORE_MOD=SCORE_MOD, SCORE_GRAD=SCORE_GRAD, MASK_MOD=MASK_MOD, KINDS=KINDS,
            MASK=True,
        )  # fmt: skip

    # dQ_i = scale * sum_j dS_ij K_j
    dq = dq * scale
    DQ_blk = DQ + b * stride_dqb + h * stride_dqh + rows * stride_dqn
    _store_block(DQ_blk, dq.to(DQ.dtype.element_ty), offs_m, offs_d, stride_dqn, stride_dqd, in_q, HEAD_DIM)
