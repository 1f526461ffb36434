"""Changes from core/kernel.py (``_dkdv_kernel``): the query heads of a group in one loop, the optional atomic
dQ partials, and the mask contract's variants, dropout and ``seqlens_k``.

dK and dV of the Triton backward (FlashAttention-2 Alg. 2, the outer loop over key blocks).

A program owns key block ``j`` of one key/value head and walks the query blocks (and, with grouped-query
attention, the ``GROUP`` query heads) that see it, accumulating

    dV_j = sum_i P_ij^T dO_i,    dK_j = scale * sum_i dS_ij^T Q_i,    dS_ij = P_ij * (dO_i V_j^T - delta_i)

with ``P_ij = exp(S_ij - lse_i)`` recomputed from the saved log-sum-exp; with ``DQ_ATOMIC`` (the one-kernel
backward) it also adds each step's dQ partial into a float32 buffer. :mod:`.backward` has the whole scheme
and the helpers both passes share; the loop is in :mod:`.backward_dkdv_inner`.
"""

from __future__ import annotations

import triton
from triton import language as tl

from .backward import _causal_query_range
from .backward_dkdv_inner import _attn_bwd_dkdv_inner
from .dropout import _packed_dropout
from .grid import INDEX, program_block
from .masking import _sequence, _window_query_range
from .tiles import _load_block, _load_block_hi, _store_block, _store_block_hi


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
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dkd,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_dvd,
    stride_dqb,
    stride_dqh,
    stride_dqn,
    stride_dqd,
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
    DQ_ATOMIC: tl.constexpr = False,
    GRID_ORDER: tl.constexpr = 2,  # under causal: LONGEST (2) or PER_HEAD (1), see .grid
    SCORE_MOD: tl.constexpr = None,
    SCORE_GRAD: tl.constexpr = None,
    MASK_MOD: tl.constexpr = None,
    KINDS: tl.constexpr = False,
    LISTED: tl.constexpr = False,
    BLOCK_D2: tl.constexpr = 0,
):
    """Grid ``(cdiv(N_k, BLOCK_N) * B * H_kv,)``, the key block fastest. ``DK, DV`` have K's and V's shapes
    ``(B, H_kv, N_k, .)``; query heads ``h_kv * GROUP ... h_kv * GROUP + GROUP - 1`` read key head h_kv.
    Variants as in :func:`~.forward.attn_fwd`; ``qk_scale = scale * log2(e)`` here, with its sign. With
    ``TMA`` ``Q`` and ``DO`` are tensor descriptors of blocks ``(1, 1, BLOCK_M, .)``.

    ``DQ_ATOMIC``: the one-kernel backward. Each step also adds its dQ partial ``scale dS_ij K_j`` into
    ``DQ``, a zeroed fp32 buffer of Q's shape ``(B, H_q, N_q, D)``, by atomic adds (the order in which key
    blocks arrive varies from run to run, so the sum's rounding does); otherwise ``DQ`` is unused.

    ``SCORE_MOD``, ``SCORE_GRAD``, ``MASK_MOD`` and ``KINDS`` as in :func:`~.backward_dq.attn_bwd_dq`, the
    kinds at this launch's tiles; ``LISTED`` with ``TILE_LIST`` the list of each key block's visited query
    tiles (:func:`flashattn_teach.triton.variants.tile_list` of the transposed kinds, row ``j`` at ``b *
    stride_list_b + h0 * stride_list_h + j * stride_list_m``), one for the whole group. ``BLOCK_D2`` as in
    :func:`~.forward.attn_fwd`: K_j, dK_j (and the dQ partial) in two lane groups, by pointers only."""
    tl.static_assert(not (TMA and VARLEN), "packed sequences end inside the tensor, where no TMA box stops")
    tl.static_assert(not DQ_ATOMIC or (WITH_DK and WITH_DV), "the one-kernel backward is not split")
    n_blocks = tl.cdiv(N_k, BLOCK_N)
    # causal: the first key blocks are seen by the most queries; they start first (all heads' or each head's:
    # GRID_ORDER, .grid). A program reads the query and dO rows of GROUP query heads.
    j, bh = program_block(
        tl.program_id(0), n_blocks, tl.num_programs(0) // n_blocks, N_q * GROUP,
        ORDER=GRID_ORDER if CAUSAL else INDEX, LONGEST_LAST=False, ROW_BYTES=2 * (HEAD_DIM + HEAD_DIM_V),
    )  # fmt: skip
    start_n = j * BLOCK_N
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
        DQ = DQ + q_start * stride_dqn
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
    k_rows = in_k
    if SEQLENS and DQ_ATOMIC:
        # keys past seqlens_k[b] read 0: their dQ partials vanish (their own dK_j, dV_j rows are zeroed below)
        k_rows = in_k & (start_n + offs_n < tl.load(SEQLENS_K + b))
    k = _load_block(K_blk, offs_n, offs_d, stride_kn, stride_kd, k_rows, HEAD_DIM, BLOCK_D, ROWS_OK=False)
    v = _load_block(V_blk, offs_n, offs_dv, stride_vn, stride_vd, in_k, HEAD_DIM_V, BLOCK_DV, ROWS_OK=False)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    k2 = k  # with BLOCK_D2 K_j's and dK_j's second lane groups (.tiles); otherwise unread
    dk2 = dk
    if BLOCK_D2 > 0:
        tl.static_assert(not TMA, "a split head dim reads its two lane groups through pointers")
        k2 = _load_block_hi(K_blk, offs_n, stride_kn, stride_kd, k_rows, HEAD_DIM, BLOCK_D, BLOCK_D2, ROWS_OK=False)
        dk2 = tl.zeros([BLOCK_N, BLOCK_D2], dtype=tl.float32)

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
    KINDS_col = TILE_KINDS + b * stride_kind_b + h0 * stride_kind_h + j * stride_kind_n  # read only with KINDS
    LIST_col = TILE_LIST + b * stride_list_b + h0 * stride_list_h + j * stride_list_m  # read only with LISTED
    DQ_group = DQ + b * stride_dqb + h0 * stride_dqh
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
    if LISTED:
        # the block mask's visited query tiles, all masked (the causal, window and length bounds still apply)
        dk, dk2, dv = _attn_bwd_dkdv_inner(
            dk, dk2, dv, k, k2, v, Q_group, DO_group, b_coord, h0_coord, LSE2_group, DELTA_group, stride_lse_h,
            stride_qh, stride_qn, stride_qd, stride_doh, stride_don, stride_dod, GROUP,
            0, tl.load(LIST_col), start_n, N_q, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, SLOPES_group,
            stride_slope_h,
            seed, drop_offset, drop_bh0, drop_N_q, drop_N_k, dropout_threshold, keep_scale,
            MASK_group, stride_mask_h, stride_mask_m, stride_mask_n, DQ_group, stride_dqh, stride_dqn,
            stride_dqd, scale,
            C0, C1, C2, C3, MC0, MC1, MC2, MC3, KINDS_col, stride_kind_h, stride_kind_m, LIST_col,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
            BOOL_MASK, ADD_MASK, DOT_PRECISION,
            WITH_DK, WITH_DV, TMA=TMA, MASK=True, DQ_ATOMIC=DQ_ATOMIC,
            SCORE_MOD=SCORE_MOD, SCORE_GRAD=SCORE_GRAD, MASK_MOD=MASK_MOD, KINDS=KINDS, LISTED=True, BLOCK_D2=BLOCK_D2,
        )  # fmt: skip
    else:
        # (start_m, end_m, MASK) of the three stages: the diagonal (the window's right side), the full blocks, the
        # ragged last block (and the window's left side)
        dk, dk2, dv = _attn_bwd_dkdv_inner(
            dk, dk2, dv, k, k2, v, Q_group, DO_group, b_coord, h0_coord, LSE2_group, DELTA_group, stride_lse_h,
            stride_qh, stride_qn, stride_qd, stride_doh, stride_don, stride_dod, GROUP,
            begin, diag_end, start_n, N_q, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, SLOPES_group, stride_slope_h,
            seed, drop_offset, drop_bh0, drop_N_q, drop_N_k, dropout_threshold, keep_scale,
            MASK_group, stride_mask_h, stride_mask_m, stride_mask_n, DQ_group, stride_dqh, stride_dqn,
            stride_dqd, scale,
            C0, C1, C2, C3, MC0, MC1, MC2, MC3, KINDS_col, stride_kind_h, stride_kind_m, LIST_col,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
            BOOL_MASK, ADD_MASK, DOT_PRECISION,
            WITH_DK, WITH_DV, TMA=TMA, MASK=True, DQ_ATOMIC=DQ_ATOMIC,
            SCORE_MOD=SCORE_MOD, SCORE_GRAD=SCORE_GRAD, MASK_MOD=MASK_MOD, KINDS=KINDS, BLOCK_D2=BLOCK_D2,
        )  # fmt: skip
        dk, dk2, dv = _attn_bwd_dkdv_inner(
            dk, dk2, dv, k, k2, v, Q_group, DO_group, b_coord, h0_coord, LSE2_group, DELTA_group, stride_lse_h,
            stride_qh, stride_qn, stride_qd, stride_doh, stride_don, stride_dod, GROUP,
            diag_end, full_end, start_n, N_q, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, SLOPES_group, stride_slope_h,
            seed, drop_offset, drop_bh0, drop_N_q, drop_N_k, dropout_threshold, keep_scale,
            MASK_group, stride_mask_h, stride_mask_m, stride_mask_n, DQ_group, stride_dqh, stride_dqn,
            stride_dqd, scale,
            C0, C1, C2, C3, MC0, MC1, MC2, MC3, KINDS_col, stride_kind_h, stride_kind_m, LIST_col,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
            BOOL_MASK, ADD_MASK, DOT_PRECISION,
            WITH_DK, WITH_DV, TMA=TMA, MASK=False, DQ_ATOMIC=DQ_ATOMIC,
            SCORE_MOD=SCORE_MOD, SCORE_GRAD=SCORE_GRAD, MASK_MOD=MASK_MOD, KINDS=KINDS, BLOCK_D2=BLOCK_D2,
        )  # fmt: skip
        dk, dk2, dv = _attn_bwd_dkdv_inner(
            dk, dk2, dv, k, k2, v, Q_group, DO_group, b_coord, h0_coord, LSE2_group, DELTA_group, stride_lse_h,
            stride_qh, stride_qn, stride_qd, stride_doh, stride_don, stride_dod, GROUP,
            full_end, end, start_n, N_q, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, SLOPES_group, stride_slope_h,
            seed, drop_offset, drop_bh0, drop_N_q, drop_N_k, dropout_threshold, keep_scale,
            MASK_group, stride_mask_h, stride_mask_m, stride_mask_n, DQ_group, stride_dqh, stride_dqn,
            stride_dqd, scale,
            C0, C1, C2, C3, MC0, MC1, MC2, MC3, KINDS_col, stride_kind_h, stride_kind_m, LIST_col,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
            BOOL_MASK, ADD_MASK, DOT_PRECISION,
            WITH_DK, WITH_DV, TMA=TMA, MASK=True, DQ_ATOMIC=DQ_ATOMIC,
            SCORE_MOD=SCORE_MOD, SCORE_GRAD=SCORE_GRAD, MASK_MOD=MASK_MOD, KINDS=KINDS, BLOCK_D2=BLOCK_D2,
        )  # fmt: skip
    if SEQLENS:
        # keys past the length were summed like visible ones (a key's row of dK, dV depends on that key
        # alone), and no row sees them: their gradient is 0
        seen = start_n + offs_n < tl.load(SEQLENS_K + b)
        dk = tl.where(seen[:, None], dk, 0.0)
        if BLOCK_D2 > 0:
            dk2 = tl.where(seen[:, None], dk2, 0.0)
        dv = tl.where(seen[:, None], dv, 0.0)

    # each output pointer is formed just before its store: one fewer 64-bit register live at the peak
    if WITH_DK:
        # dK_j = scale * sum_i dS_ij^T Q_i (with DQ_ATOMIC each dS_ij came scaled)
        if not DQ_ATOMIC:
            dk = dk * scale
        DK_blk = DK + b * stride_dkb + h_kv * stride_dkh + cols * stride_dkn
        _store_block(DK_blk, dk.to(DK.dtype.element_ty), offs_n, offs_d, stride_dkn, stride_dkd, in_k, HEAD_DIM)
        if BLOCK_D2 > 0:
            if not DQ_ATOMIC:
                dk2 = dk2 * scale
            _store_block_hi(
                DK_blk, dk2.to(DK.dtype.element_ty), offs_n, stride_dkn, stride_dkd, in_k, HEAD_DIM, BLOCK_D, BLOCK_D2
            )
    if WITH_DV:
        DV_blk = DV + b * stride_dvb + h_kv * stride_dvh + cols * stride_dvn
        _store_block(DV_blk, dv.to(DV.dtype.element_ty), offs_n, offs_dv, stride_dvn, stride_dvd, in_k, HEAD_DIM_V)
