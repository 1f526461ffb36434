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
from .records import Strided
from .tiles import _load_block, _load_block_hi, _store_block, _store_block_hi


@triton.jit
def attn_bwd_dkdv(
    ptr,
    stride,
    row_stats,
    H_q,
    H_kv,
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
    WITH_DK: tl.constexpr,
    WITH_DV: tl.constexpr,
    DQ_ATOMIC: tl.constexpr = False,
    SCORE_GRAD: tl.constexpr = None,
):
    """Grid ``(cdiv(N_k, BLOCK_N) * B * H_kv,)``, the key block fastest. ``ptr, stride``: the
    tensors' pointers and strides (:func:`~.records.split` of a :class:`~.records.DkdvTensors`), made again into
    ``Q, K, V, DO, DK, DV, DQ`` (:class:`~.records.Strided`) in the first lines, ``DK, DV`` of K's and V's
    shapes ``(B, H_kv, N_k, .)``; query heads ``h_kv *
    GROUP ... h_kv * GROUP + GROUP - 1`` read key head h_kv. ``row_stats`` as in
    :func:`~.backward_dq.attn_bwd_dq`; the variants' records and flags ``F`` as in :func:`~.forward.attn_fwd`;
    ``qk_scale = scale * log2(e)`` here, with its sign. With ``TMA`` the pointers of ``Q`` and ``DO`` are tensor
    descriptors of blocks ``(1, 1, BLOCK_M, .)``.

    ``DQ_ATOMIC``: the one-kernel backward. Each step also adds its dQ partial ``scale dS_ij K_j`` into
    ``DQ``, a zeroed fp32 buffer of Q's shape ``(B, H_q, N_q, D)``, by atomic adds (the order in which key
    blocks arrive varies from run to run, so the sum's rounding does); otherwise ``DQ`` is None.

    ``SCORE_MOD``, ``SCORE_GRAD``, ``MASK_MOD`` and ``KINDS`` as in :func:`~.backward_dq.attn_bwd_dq`, the
    kinds at this launch's tiles; ``LISTED`` with ``mods.tiles`` the list of each key block's visited query
    tiles (:func:`flashattn_teach.triton.variants.tile_list` of the transposed kinds, row ``j`` at ``b *
    stride_b + h0 * stride_h + j * stride_m``), one for the whole group. ``BLOCK_D2`` as in
    :func:`~.forward.attn_fwd`: K_j, dK_j (and the dQ partial) in two lane groups, by pointers only.

    ``TRACE``: the trace build (:mod:`.trace_backward`): the program of the head ``row_stats.trace`` names
    writes each step's ``P, dP, dS, dK_j, dV_j`` (and dQ partial) there; through pointers, unsplit, one lane group."""
    # the tensors come as their pointers, then their strides (records.split: ptxas's schedule follows the layout)
    Q = Strided(ptr.Q, *stride.Q)
    K = Strided(ptr.K, *stride.K)
    V = Strided(ptr.V, *stride.V)
    DO = Strided(ptr.DO, *stride.DO)
    DK = Strided(ptr.DK, *stride.DK)
    DV = Strided(ptr.DV, *stride.DV)
    DQ = Strided(ptr.DQ, *stride.DQ)  # None fields without DQ_ATOMIC
    tl.static_assert(not (F.TMA and F.VARLEN), "packed sequences end inside the tensor, where no TMA box stops")
    tl.static_assert(not DQ_ATOMIC or (WITH_DK and WITH_DV), "the one-kernel backward is not split")
    tl.static_assert(not F.TRACE or (WITH_DK and WITH_DV and not F.TMA and F.BLOCK_D2 == 0), "the trace build's path")
    n_blocks = tl.cdiv(N_k, BLOCK_N)
    # causal: the first key blocks are seen by the most queries; they start first (all heads' or each head's:
    # GRID_ORDER, .grid). A program reads the query and dO rows of GROUP query heads.
    j, bh = program_block(
        tl.program_id(0),
        n_blocks,
        tl.num_programs(0) // n_blocks,
        N_q * GROUP,
        ORDER=F.GRID_ORDER if F.CAUSAL else INDEX,
        LONGEST_LAST=False,
        ROW_BYTES=2 * (HEAD_DIM + HEAD_DIM_V),
    )
    start_n = j * BLOCK_N
    b = (bh // H_kv).to(tl.int64)
    h_kv = (bh % H_kv).to(tl.int64)
    h0 = h_kv * GROUP  # the group's first query head; its GROUP heads are summed here rather than with atomics
    OFFSET = bounds.OFFSET
    Q_ptr, K_ptr, V_ptr, DO_ptr, DK_ptr, DV_ptr = Q.ptr, K.ptr, V.ptr, DO.ptr, DK.ptr, DV.ptr
    DQ_ptr = None
    if DQ_ATOMIC:
        DQ_ptr = DQ.ptr
    LSE2_group = row_stats.lse2 + (b * H_q + h0) * row_stats.stride_h  # lse2 and delta (B, H_q, N_q) contiguous
    DELTA_group = row_stats.delta + (b * H_q + h0) * row_stats.stride_h
    drop_offset, drop_bh0, drop_N_q, drop_N_k = dropout.offset, b * H_q + h0, N_q, N_k  # the forward's counters
    if F.VARLEN:
        # as in the forward: N_q, N_k and OFFSET become the sequence's, the bases move to its start rows
        q_start, k_start, N_q, N_k, OFFSET = _sequence(packed.cu_seqlens_q, packed.cu_seqlens_k, b, OFFSET)
        if start_n >= N_k:
            return  # a key block past this sequence's end
        if F.DROPOUT:
            n_seq = tl.num_programs(0) // (n_blocks * H_kv)
            drop_offset, drop_N_q, drop_N_k = _packed_dropout(
                packed.cu_seqlens_q, packed.cu_seqlens_k, n_seq, q_start, k_start, dropout.offset
            )
            drop_bh0 = h0
        Q_ptr = Q_ptr + q_start * Q.stride_n
        DO_ptr = DO_ptr + q_start * DO.stride_n
        K_ptr = K_ptr + k_start * K.stride_n
        V_ptr = V_ptr + k_start * V.stride_n
        DK_ptr = DK_ptr + k_start * DK.stride_n
        DV_ptr = DV_ptr + k_start * DV.stride_n
        if DQ_ATOMIC:
            DQ_ptr = DQ_ptr + q_start * DQ.stride_n
        LSE2_group = row_stats.lse2 + h0 * row_stats.stride_h + q_start  # lse2 and delta (H_q, total_q)
        DELTA_group = row_stats.delta + h0 * row_stats.stride_h + q_start
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_k = start_n + offs_n < N_k
    cols = start_n.to(tl.int64)
    # K_j: (BLOCK_N, BLOCK_D), V_j: (BLOCK_N, BLOCK_DV), loaded once
    K_blk = K_ptr + b * K.stride_b + h_kv * K.stride_h + cols * K.stride_n
    V_blk = V_ptr + b * V.stride_b + h_kv * V.stride_h + cols * V.stride_n
    k_rows = in_k
    if F.SEQLENS and DQ_ATOMIC:
        # keys past seqlens_k[b] read 0: their dQ partials vanish (their own dK_j, dV_j rows are zeroed below)
        k_rows = in_k & (start_n + offs_n < tl.load(bounds.SEQLENS_K + b))
    k = _load_block(K_blk, offs_n, offs_d, K.stride_n, K.stride_d, k_rows, HEAD_DIM, BLOCK_D, ROWS_OK=False)
    v = _load_block(V_blk, offs_n, offs_dv, V.stride_n, V.stride_d, in_k, HEAD_DIM_V, BLOCK_DV, ROWS_OK=False)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    k2 = k  # with BLOCK_D2 K_j's and dK_j's second lane groups (.tiles); otherwise unread
    dk2 = dk
    if F.BLOCK_D2 > 0:
        tl.static_assert(not F.TMA, "a split head dim reads its two lane groups through pointers")
        k2 = _load_block_hi(K_blk, offs_n, K.stride_n, K.stride_d, k_rows, HEAD_DIM, BLOCK_D, F.BLOCK_D2, ROWS_OK=False)
        dk2 = tl.zeros([BLOCK_N, F.BLOCK_D2], dtype=tl.float32)

    b_coord = bh // H_kv
    h0_coord = (bh % H_kv) * GROUP
    if F.TMA:
        Q_group = Q_ptr
        DO_group = DO_ptr
    else:
        Q_group = Q_ptr + b * Q.stride_b + h0 * Q.stride_h
        DO_group = DO_ptr + b * DO.stride_b + h0 * DO.stride_h
    SLOPES_group = None
    if F.ALIBI:
        SLOPES_group = terms.alibi + b * terms.alibi_stride_b + h0 * terms.alibi_stride_h
    MASK_group = None
    if F.BOOL_MASK or F.ADD_MASK:
        MASK_group = terms.mask + b * terms.mask_stride_b + h0 * terms.mask_stride_h
    KINDS_col = None
    if F.KINDS:
        KINDS_col = mods.kinds + b * mods.kinds_stride_b + h0 * mods.kinds_stride_h + j * mods.kinds_stride_n
    LIST_col = None
    if F.LISTED:
        LIST_col = mods.tiles + b * mods.tiles_stride_b + h0 * mods.tiles_stride_h + j * mods.tiles_stride_m
    DQ_group = None
    if DQ_ATOMIC:
        DQ_group = DQ_ptr + b * DQ.stride_b + h0 * DQ.stride_h
    if F.SEQLENS:
        # OFFSET is the alignment (1: bottom-right, 0: top-left): off_b = seqlens_k[b] - N_q, flash-attn's
        OFFSET = OFFSET * (tl.minimum(tl.load(bounds.SEQLENS_K + b), N_k) - N_q)
    if F.WINDOW:
        begin, diag_end, full_end, end = _window_query_range(
            start_n, N_q, OFFSET, bounds.LEFT, bounds.RIGHT, BLOCK_M, BLOCK_N
        )
    else:
        begin, diag_end, full_end = _causal_query_range(start_n, N_q, OFFSET, BLOCK_M, BLOCK_N, F.CAUSAL)
        end = N_q
    if F.SEQLENS:
        # a key block past this batch element's length is seen by no row: no stage runs, dK_j = dV_j = 0
        end = tl.where(start_n < tl.load(bounds.SEQLENS_K + b), end, begin)
        diag_end = tl.minimum(diag_end, end)
        full_end = tl.minimum(full_end, end)
    # The query loop's stages, one call site (unrolled: each stage its own inlined loop):
    #   0  LISTED: the block mask's visited query tiles, all masked (the causal, window and length bounds
    #      still apply); otherwise the diagonal (the window's right side), masked
    #   1  the full blocks, unmasked                                         (not with LISTED)
    #   2  the ragged last block (and the window's left side), masked       (not with LISTED)
    for stage in tl.static_range(3):
        if stage == 0 or not F.LISTED:
            if stage == 0:
                if F.LISTED:
                    lo, hi = 0, tl.load(LIST_col)  # entries of the tile list, not rows
                else:
                    lo, hi = begin, diag_end
            elif stage == 1:
                lo, hi = diag_end, full_end
            else:
                lo, hi = full_end, end
            dk, dk2, dv = _attn_bwd_dkdv_inner(
                dk,
                dk2,
                dv,
                k=k,
                k2=k2,
                v=v,
                Q_group=Q_group,
                DO_group=DO_group,
                Q=Q,
                DO=DO,
                DQ=DQ,
                b_coord=b_coord,
                h0_coord=h0_coord,
                LSE2_group=LSE2_group,
                DELTA_group=DELTA_group,
                row_stats=row_stats,
                GROUP=GROUP,
                start_m=lo,
                end_m=hi,
                start_n=start_n,
                N_q=N_q,
                qk_scale=qk_scale,
                OFFSET=OFFSET,
                bounds=bounds,
                terms=terms,
                SLOPES_group=SLOPES_group,
                dropout=dropout,
                drop_offset=drop_offset,
                drop_bh0=drop_bh0,
                drop_N_q=drop_N_q,
                drop_N_k=drop_N_k,
                MASK_group=MASK_group,
                DQ_group=DQ_group,
                scale=scale,
                mods=mods,
                KINDS_col=KINDS_col,
                LIST_col=LIST_col,
                HEAD_DIM=HEAD_DIM,
                HEAD_DIM_V=HEAD_DIM_V,
                BLOCK_D=BLOCK_D,
                BLOCK_DV=BLOCK_DV,
                BLOCK_M=BLOCK_M,
                BLOCK_N=BLOCK_N,
                F=F,
                WITH_DK=WITH_DK,
                WITH_DV=WITH_DV,
                MASK=stage != 1,
                DQ_ATOMIC=DQ_ATOMIC,
                SCORE_GRAD=SCORE_GRAD,
            )
    if F.SEQLENS:
        # keys past the length were summed like visible ones (a key's row of dK, dV depends on that key
        # alone), and no row sees them: their gradient is 0
        seen = start_n + offs_n < tl.load(bounds.SEQLENS_K + b)
        dk = tl.where(seen[:, None], dk, 0.0)
        if F.BLOCK_D2 > 0:
            dk2 = tl.where(seen[:, None], dk2, 0.0)
        dv = tl.where(seen[:, None], dv, 0.0)

    # each output pointer is formed just before its store: one fewer 64-bit register live at the peak
    if WITH_DK:
        # dK_j = scale * sum_i dS_ij^T Q_i (with DQ_ATOMIC each dS_ij came scaled)
        if not DQ_ATOMIC:
            dk = dk * scale
        DK_blk = DK_ptr + b * DK.stride_b + h_kv * DK.stride_h + cols * DK.stride_n
        _store_block(DK_blk, dk.to(DK_ptr.dtype.element_ty), offs_n, offs_d, DK.stride_n, DK.stride_d, in_k, HEAD_DIM)
        if F.BLOCK_D2 > 0:
            if not DQ_ATOMIC:
                dk2 = dk2 * scale
            dk2 = dk2.to(DK_ptr.dtype.element_ty)
            _store_block_hi(DK_blk, dk2, offs_n, DK.stride_n, DK.stride_d, in_k, HEAD_DIM, BLOCK_D, F.BLOCK_D2)
    if WITH_DV:
        DV_blk = DV_ptr + b * DV.stride_b + h_kv * DV.stride_h + cols * DV.stride_n
        dv = dv.to(DV_ptr.dtype.element_ty)
        _store_block(DV_blk, dv, offs_n, offs_dv, DV.stride_n, DV.stride_d, in_k, HEAD_DIM_V)
