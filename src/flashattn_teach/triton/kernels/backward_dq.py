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
from .records import Strided
from .tiles import _load_block, _load_block_hi, _store_block, _store_block_hi


@triton.jit
def attn_bwd_dq(
    ptr,
    stride,
    row_stats,
    H_q,
    N_q,
    N_k,
    GROUP,
    scale,
    qk_scale,
    bounds,
    terms,
    dropout,
    packed,
    mods,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    F: tl.constexpr,
    SCORE_GRAD: tl.constexpr = None,
):
    """Grid ``(cdiv(N_q, BLOCK_M) * B * H_q,)``, the query block fastest; causal runs the last (longest)
    query blocks first. ``Q, K, V, DO, DQ`` (:class:`~.records.Strided`) come as ``ptr, stride``
    (:func:`~.records.split` of a :class:`~.records.DqTensors`) and are made again in the first lines, ``DQ``
    of Q's shape ``(B, H_q,
    N_q, D)``; with ``TMA`` the pointers of ``K`` and ``V`` are tensor descriptors of blocks ``(1, 1,
    BLOCK_N, .)``. ``row_stats`` (:class:`~.records.RowStats`): ``lse * log2(e)`` and ``rowsum(dO * O)``,
    laid out as the forward's lse. ``bounds``, ``terms``, ``dropout``, ``packed``, ``mods`` and the flags ``F``
    (``F.SCORE_MOD``, ``F.MASK_MOD``, ``F.KINDS``, ``F.LISTED``, ``F.BLOCK_D2`` ...) as in
    :func:`~.forward.attn_fwd`, at this launch's tiles; ``SCORE_GRAD``: score_mod's derivative (None when it is
    1). ``F.TRACE`` as in :func:`~.backward_dkdv.attn_bwd_dkdv`: each step's ``P, dP, dS``, its ``dS_ij K_j``
    and ``dQ_i``."""
    # the tensors come as their pointers, then their strides (records.split: ptxas's schedule follows the layout)
    Q = Strided(ptr.Q, *stride.Q)
    K = Strided(ptr.K, *stride.K)
    V = Strided(ptr.V, *stride.V)
    DO = Strided(ptr.DO, *stride.DO)
    DQ = Strided(ptr.DQ, *stride.DQ)
    tl.static_assert(not (F.TMA and F.VARLEN), "packed sequences end inside the tensor, where no TMA box stops")
    tl.static_assert(
        not F.TRACE or (not F.TMA and F.BLOCK_D2 == 0), "the trace build runs through pointers, one lane group"
    )
    n_blocks = tl.cdiv(N_q, BLOCK_M)
    # causal: the last query blocks see the most keys; they start first (all heads' or each head's: GRID_ORDER)
    blk, bh = program_block(
        tl.program_id(0),
        n_blocks,
        tl.num_programs(0) // n_blocks,
        N_k,
        ORDER=F.GRID_ORDER if F.CAUSAL else INDEX,
        LONGEST_LAST=True,
        ROW_BYTES=2 * (HEAD_DIM + HEAD_DIM_V),
    )
    start_m = blk * BLOCK_M
    b = (bh // H_q).to(tl.int64)
    h = (bh % H_q).to(tl.int64)
    h_kv = h // GROUP
    b_coord = bh // H_q  # 32-bit descriptor coordinates
    h_coord = (bh % H_q) // GROUP
    OFFSET = bounds.OFFSET
    Q_ptr, K_ptr, V_ptr, DO_ptr, DQ_ptr = Q.ptr, K.ptr, V.ptr, DO.ptr, DQ.ptr
    stats = bh.to(tl.int64) * row_stats.stride_h + start_m  # lse2 and delta are (B, H_q, N_q) contiguous
    drop_offset, drop_bh, drop_N_q, drop_N_k = dropout.offset, bh, N_q, N_k  # the forward's dropout counters
    if F.VARLEN:
        # as in the forward: N_q, N_k and OFFSET become the sequence's, the bases move to its start rows
        q_start, k_start, N_q, N_k, OFFSET = _sequence(packed.cu_seqlens_q, packed.cu_seqlens_k, b, OFFSET)
        if start_m >= N_q:
            return  # a query block past this sequence's end
        if F.DROPOUT:
            n_seq = tl.num_programs(0) // (n_blocks * H_q)
            drop_offset, drop_N_q, drop_N_k = _packed_dropout(
                packed.cu_seqlens_q, packed.cu_seqlens_k, n_seq, q_start, k_start, dropout.offset
            )
            drop_bh = h
        Q_ptr = Q_ptr + q_start * Q.stride_n
        DO_ptr = DO_ptr + q_start * DO.stride_n
        DQ_ptr = DQ_ptr + q_start * DQ.stride_n
        K_ptr = K_ptr + k_start * K.stride_n
        V_ptr = V_ptr + k_start * V.stride_n
        stats = h * row_stats.stride_h + q_start + start_m  # lse2 and delta (H_q, total_q)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_q = start_m + offs_m < N_q
    rows = start_m.to(tl.int64)
    Q_blk = Q_ptr + b * Q.stride_b + h * Q.stride_h + rows * Q.stride_n
    DO_blk = DO_ptr + b * DO.stride_b + h * DO.stride_h + rows * DO.stride_n
    if F.TMA:
        K_head = K_ptr
        V_head = V_ptr
    else:
        K_head = K_ptr + b * K.stride_b + h_kv * K.stride_h
        V_head = V_ptr + b * V.stride_b + h_kv * V.stride_h
    # Q_i: (BLOCK_M, BLOCK_D), dO_i: (BLOCK_M, BLOCK_DV) and the row statistics, loaded once
    q = _load_block(Q_blk, offs_m, offs_d, Q.stride_n, Q.stride_d, in_q, HEAD_DIM, BLOCK_D, ROWS_OK=False)
    do = _load_block(DO_blk, offs_m, offs_dv, DO.stride_n, DO.stride_d, in_q, HEAD_DIM_V, BLOCK_DV, ROWS_OK=False)
    lse2 = tl.load(row_stats.lse2 + stats + offs_m, mask=in_q, other=0.0)  # lse_i * log2(e), +inf for no key
    delta = tl.load(row_stats.delta + stats + offs_m, mask=in_q, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    q2 = q  # with BLOCK_D2 Q_i's and dQ_i's second lane groups (.tiles), by pointers only; otherwise unread
    dq2 = dq
    if F.BLOCK_D2 > 0:
        tl.static_assert(not F.TMA, "a split head dim reads its two lane groups through pointers")
        q2 = _load_block_hi(Q_blk, offs_m, Q.stride_n, Q.stride_d, in_q, HEAD_DIM, BLOCK_D, F.BLOCK_D2, ROWS_OK=False)
        dq2 = tl.zeros([BLOCK_M, F.BLOCK_D2], dtype=tl.float32)

    MASK_head = None
    if F.BOOL_MASK or F.ADD_MASK:
        MASK_head = terms.mask + b * terms.mask_stride_b + h * terms.mask_stride_h
    KINDS_row = None
    if F.KINDS:
        KINDS_row = mods.kinds + b * mods.kinds_stride_b + h * mods.kinds_stride_h + blk * mods.kinds_stride_m
    LIST_row = None
    if F.LISTED:
        LIST_row = mods.tiles + b * mods.tiles_stride_b + h * mods.tiles_stride_h + blk * mods.tiles_stride_m
    n_keys = N_k  # the keys that exist for this batch element
    if F.SEQLENS:
        n_keys = tl.minimum(tl.load(bounds.SEQLENS_K + b), N_k)  # keys past this batch element's length are invisible
        # OFFSET is the alignment (1: bottom-right, 0: top-left): off_b = seqlens_k[b] - N_q, flash-attn's
        OFFSET = OFFSET * (n_keys - N_q)
    if F.ALIBI:
        slope_log2 = tl.load(terms.alibi + b * terms.alibi_stride_b + h * terms.alibi_stride_h) * LOG2E
    else:
        slope_log2 = 0.0
    if F.WINDOW:
        begin, full_begin, full_end, end = _window_key_range(
            start_m, n_keys, OFFSET, bounds.LEFT, bounds.RIGHT, BLOCK_M, BLOCK_N
        )
    else:
        begin = 0
        full_begin = 0
        full_end, end = _causal_key_range(start_m, n_keys, OFFSET, BLOCK_M, BLOCK_N, F.CAUSAL)
    # The key loop's stages, one call site (unrolled: each stage its own inlined loop):
    #   0  LISTED: the block mask's visited tiles, all masked (the causal, window and length bounds still
    #      apply); WINDOW: the blocks some row's left bound cuts, masked
    #   1  the key blocks every row fully sees, unmasked                    (not with LISTED)
    #   2  the diagonal (the window's right side) and the ragged last block (not with LISTED)
    for stage in tl.static_range(3):
        if (stage == 0 and (F.LISTED or F.WINDOW)) or (stage > 0 and not F.LISTED):
            if stage == 0:
                if F.LISTED:
                    lo, hi = 0, tl.load(LIST_row)  # entries of the tile list, not keys
                else:
                    lo, hi = begin, full_begin
            elif stage == 1:
                lo, hi = full_begin, full_end
            else:
                lo, hi = full_end, end
            dq, dq2 = _attn_bwd_dq_inner(
                dq,
                dq2,
                q=q,
                q2=q2,
                do=do,
                lse2=lse2,
                delta=delta,
                K_head=K_head,
                V_head=V_head,
                K=K,
                V=V,
                b_coord=b_coord,
                h_coord=h_coord,
                start_n=lo,
                end_n=hi,
                start_m=start_m,
                N_k=n_keys,
                qk_scale=qk_scale,
                OFFSET=OFFSET,
                bounds=bounds,
                terms=terms,
                slope_log2=slope_log2,
                dropout=dropout,
                drop_offset=drop_offset,
                drop_bh=drop_bh,
                drop_N_q=drop_N_q,
                drop_N_k=drop_N_k,
                MASK_head=MASK_head,
                b_idx=b_coord,
                h_idx=bh % H_q,
                mods=mods,
                KINDS_row=KINDS_row,
                LIST_row=LIST_row,
                HEAD_DIM=HEAD_DIM,
                HEAD_DIM_V=HEAD_DIM_V,
                BLOCK_D=BLOCK_D,
                BLOCK_DV=BLOCK_DV,
                BLOCK_M=BLOCK_M,
                BLOCK_N=BLOCK_N,
                F=F,
                MASK=stage != 1,
                SCORE_GRAD=SCORE_GRAD,
                Trace=row_stats.trace,
            )

    # dQ_i = scale * sum_j dS_ij K_j
    dq = dq * scale
    DQ_blk = DQ_ptr + b * DQ.stride_b + h * DQ.stride_h + rows * DQ.stride_n
    _store_block(DQ_blk, dq.to(DQ_ptr.dtype.element_ty), offs_m, offs_d, DQ.stride_n, DQ.stride_d, in_q, HEAD_DIM)
    if F.BLOCK_D2 > 0:
        dq2 = dq2 * scale
        dq2 = dq2.to(DQ_ptr.dtype.element_ty)
        _store_block_hi(DQ_blk, dq2, offs_m, DQ.stride_n, DQ.stride_d, in_q, HEAD_DIM, BLOCK_D, F.BLOCK_D2)
