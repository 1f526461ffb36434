"""Changes from core/kernel.py (``_dq_kernel``): strided and grouped inputs, packed sequences, the mask
contract's stages and variants, dropout.

dQ of the Triton backward (FlashAttention-2 Alg. 2, the pass over query blocks).

A program owns query block ``i`` of one query head and walks the key blocks it sees, accumulating
``dQ_i = scale * sum_j dS_ij K_j`` with ``dS_ij = P_ij * (dO_i V_j^T - delta_i)`` and ``P_ij`` recomputed
from the saved log-sum-exp. :mod:`.backward` has the whole scheme and the helpers both passes share.
"""

from __future__ import annotations

import triton
from triton import language as tl

from .backward_dq_inner import _attn_bwd_dq_inner
from .dropout import _packed_dropout
from .forward import LOG2E, _causal_key_range
from .grid import INDEX, program_block
from .masking import _sequence, _window_key_range
from .tiles import _load_block, _load_block_hi, _store_block, _store_block_hi


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
    GRID_ORDER: tl.constexpr = 2,  # under causal: LONGEST (2) or PER_HEAD (1), see .grid
    SCORE_MOD: tl.constexpr = None,
    SCORE_GRAD: tl.constexpr = None,
    MASK_MOD: tl.constexpr = None,
    KINDS: tl.constexpr = False,
    LISTED: tl.constexpr = False,
    BLOCK_D2: tl.constexpr = 0,
):
    """Grid ``(cdiv(N_q, BLOCK_M) * B * H_q,)``, the query block fastest; causal runs the last (longest)
    query blocks first. ``DQ`` has Q's shape ``(B, H_q, N_q, D)``. With ``TMA`` ``K`` and ``V`` are tensor
    descriptors of blocks ``(1, 1, BLOCK_N, .)``. ``SCORE_MOD``, ``SCORE_GRAD`` (its derivative; None when
    it is 1), ``MASK_MOD``, ``KINDS``, ``LISTED`` and ``BLOCK_D2`` as in :func:`~.forward.attn_fwd`, at this
    launch's tiles."""
    tl.static_assert(not (TMA and VARLEN), "packed sequences end inside the tensor, where no TMA box stops")
    n_blocks = tl.cdiv(N_q, BLOCK_M)
    # causal: the last query blocks see the most keys; they start first (all heads' or each head's: GRID_ORDER)
    blk, bh = program_block(
        tl.program_id(0), n_blocks, tl.num_programs(0) // n_blocks, N_k,
        ORDER=GRID_ORDER if CAUSAL else INDEX, LONGEST_LAST=True, ROW_BYTES=2 * (HEAD_DIM + HEAD_DIM_V),
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
    q2 = q  # with BLOCK_D2 Q_i's and dQ_i's second lane groups (.tiles), by pointers only; otherwise unread
    dq2 = dq
    if BLOCK_D2 > 0:
        tl.static_assert(not TMA, "a split head dim reads its two lane groups through pointers")
        q2 = _load_block_hi(Q_blk, offs_m, stride_qn, stride_qd, in_q, HEAD_DIM, BLOCK_D, BLOCK_D2, ROWS_OK=False)
        dq2 = tl.zeros([BLOCK_M, BLOCK_D2], dtype=tl.float32)

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
        dq, dq2 = _attn_bwd_dq_inner(
            dq, dq2, q, q2, do, lse2, delta, K_head, V_head, b_coord, h_coord,
            stride_kn, stride_kd, stride_vn, stride_vd,
            0, tl.load(LIST_row), start_m, n_keys, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, slope_log2,
            seed, drop_offset, drop_bh, drop_N_q, drop_N_k, dropout_threshold, keep_scale,
            MASK_head, stride_mask_m, stride_mask_n,
            b_coord, bh % H_q, C0, C1, C2, C3, MC0, MC1, MC2, MC3, KINDS_row, stride_kind_n, LIST_row,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
            BOOL_MASK, ADD_MASK, DOT_PRECISION, TMA=TMA,
            SCORE_MOD=SCORE_MOD, SCORE_GRAD=SCORE_GRAD, MASK_MOD=MASK_MOD, KINDS=KINDS, LISTED=True,
            MASK=True, BLOCK_D2=BLOCK_D2,
        )  # fmt: skip
    else:
        if WINDOW:
            begin, full_begin, full_end, end = _window_key_range(start_m, n_keys, OFFSET, LEFT, RIGHT, BLOCK_M, BLOCK_N)
            dq, dq2 = _attn_bwd_dq_inner(
                dq, dq2, q, q2, do, lse2, delta, K_head, V_head, b_coord, h_coord,
            stride_kn, stride_kd, stride_vn, stride_vd,
                begin, full_begin, start_m, n_keys, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, slope_log2,
                seed, drop_offset, drop_bh, drop_N_q, drop_N_k, dropout_threshold, keep_scale,
                MASK_head, stride_mask_m, stride_mask_n,
                b_coord, bh % H_q, C0, C1, C2, C3, MC0, MC1, MC2, MC3, KINDS_row, stride_kind_n, LIST_row,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
                BOOL_MASK, ADD_MASK, DOT_PRECISION, TMA=TMA,
                SCORE_MOD=SCORE_MOD, SCORE_GRAD=SCORE_GRAD, MASK_MOD=MASK_MOD, KINDS=KINDS,
                MASK=True, BLOCK_D2=BLOCK_D2,
            )  # fmt: skip
        else:
            full_begin = 0
            full_end, end = _causal_key_range(start_m, n_keys, OFFSET, BLOCK_M, BLOCK_N, CAUSAL)
        dq, dq2 = _attn_bwd_dq_inner(
            dq, dq2, q, q2, do, lse2, delta, K_head, V_head, b_coord, h_coord,
            stride_kn, stride_kd, stride_vn, stride_vd,
            full_begin, full_end, start_m, n_keys, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, slope_log2,
            seed, drop_offset, drop_bh, drop_N_q, drop_N_k, dropout_threshold, keep_scale,
            MASK_head, stride_mask_m, stride_mask_n,
            b_coord, bh % H_q, C0, C1, C2, C3, MC0, MC1, MC2, MC3, KINDS_row, stride_kind_n, LIST_row,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
            BOOL_MASK, ADD_MASK, DOT_PRECISION, TMA=TMA,
            SCORE_MOD=SCORE_MOD, SCORE_GRAD=SCORE_GRAD, MASK_MOD=MASK_MOD, KINDS=KINDS,
            MASK=False, BLOCK_D2=BLOCK_D2,
        )  # fmt: skip
        dq, dq2 = _attn_bwd_dq_inner(
            dq, dq2, q, q2, do, lse2, delta, K_head, V_head, b_coord, h_coord,
            stride_kn, stride_kd, stride_vn, stride_vd,
            full_end, end, start_m, n_keys, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, slope_log2,
            seed, drop_offset, drop_bh, drop_N_q, drop_N_k, dropout_threshold, keep_scale,
            MASK_head, stride_mask_m, stride_mask_n,
            b_coord, bh % H_q, C0, C1, C2, C3, MC0, MC1, MC2, MC3, KINDS_row, stride_kind_n, LIST_row,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
            BOOL_MASK, ADD_MASK, DOT_PRECISION, TMA=TMA,
            SCORE_MOD=SCORE_MOD, SCORE_GRAD=SCORE_GRAD, MASK_MOD=MASK_MOD, KINDS=KINDS,
            MASK=True, BLOCK_D2=BLOCK_D2,
        )  # fmt: skip

    # dQ_i = scale * sum_j dS_ij K_j
    dq = dq * scale
    DQ_blk = DQ + b * stride_dqb + h * stride_dqh + rows * stride_dqn
    _store_block(DQ_blk, dq.to(DQ.dtype.element_ty), offs_m, offs_d, stride_dqn, stride_dqd, in_q, HEAD_DIM)
    if BLOCK_D2 > 0:
        dq2 = dq2 * scale
        _store_block_hi(
            DQ_blk, dq2.to(DQ.dtype.element_ty), offs_m, stride_dqn, stride_dqd, in_q, HEAD_DIM, BLOCK_D, BLOCK_D2
        )
