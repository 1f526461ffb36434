"""The memory-efficient backward in Triton (Dao 2023, FlashAttention-2 Alg. 2), as three kernels.

Forward saved ``q, k, v, O`` and ``lse``; the probabilities are recomputed tile by tile:

    delta_i = rowsum(dO_i * O_i)                  _attn_bwd_preprocess   (Alg. 2 line 4)
    P_ij    = exp(S_ij - lse_i)                   recomputed in both passes below
    dV_j    = sum_i P_ij^T dO_i                   _attn_bwd_dkdv: a program owns key block j
    dS_ij   = P_ij * (dO_i V_j^T - delta_i)
    dK_j    = scale * sum_i dS_ij^T Q_i
    dQ_i    = scale * sum_j dS_ij K_j             _attn_bwd_dq: a program owns query block i

Each output block is written by exactly one program, so there are no atomics and the result is bitwise
the same on every run. With grouped-query attention the dK/dV program of a key/value head also visits
its ``GROUP`` query heads, in one flat loop over (query head, query block) pairs: a nested head loop
would keep the inner loop's pipeline state alive across heads and cost registers that the tile needs.

As in the forward, exponentials run in base 2 (``qk_scale = scale * log2(e)``, ``lse2 = lse * log2(e)``),
and causal masking splits each loop into stages that run with and without a mask. A query row that saw
no key has ``lse = -inf``; it is read as ``+inf`` so that its recomputed ``P`` is 0 rather than NaN.

The mask contract's variants enter as in the forward (:mod:`.masking`); softcap multiplies ``dS`` by
``1 - tanh^2`` of the capped score, and keys past ``seqlens_k[b]`` get ``dK = dV = 0``.

Grids are one-dimensional, ``n_blocks * B * H`` programs with the block index fastest, so programs of
one head run side by side (their K/V or Q/dO tiles meet in L2) and no grid axis limit applies to B * H.
Offsets are 64-bit where they can pass 2^31: each block's base pointer moves by the scalar
``start * stride_n`` in int64, while offsets inside a tile stay int32 (the launcher checks they fit).
"""

from __future__ import annotations

import triton
from triton import language as tl

from .dropout import _dropout_keep
from .forward import LOG2E, _causal_key_range
from .masking import (
    _attn_mask_tile,
    _in_window,
    _modify_scores,
    _sequence,
    _window_key_range,
    _window_query_range,
)
from .tiles import _load_block, _load_block_T, _store_block


@triton.jit
def _attn_bwd_preprocess(
    O,
    DO,
    DELTA,
    stride_ob,
    stride_oh,
    stride_on,
    stride_od,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dod,
    H_q,
    N_q,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Grid ``(cdiv(N_q, BLOCK_M) * B * H_q,)``; ``DELTA (B, H_q, N_q)`` contiguous fp32."""
    n_blocks = tl.cdiv(N_q, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // n_blocks
    start_m = (pid % n_blocks) * BLOCK_M
    b = (bh // H_q).to(tl.int64)
    h = (bh % H_q).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_q = start_m + offs_m < N_q
    O_blk = O + b * stride_ob + h * stride_oh + start_m.to(tl.int64) * stride_on
    DO_blk = DO + b * stride_dob + h * stride_doh + start_m.to(tl.int64) * stride_don
    # O_i, dO_i: (BLOCK_M, BLOCK_DV)
    o = _load_block(O_blk, offs_m, offs_dv, stride_on, stride_od, in_q, HEAD_DIM_V, BLOCK_DV, ROWS_OK=False)
    do = _load_block(DO_blk, offs_m, offs_dv, stride_don, stride_dod, in_q, HEAD_DIM_V, BLOCK_DV, ROWS_OK=False)
    # delta_i = rowsum(dO_i * O_i), in fp32; it equals rowsum(P_ij * dP_ij) summed over all key blocks j
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * N_q + start_m + offs_m, delta, mask=in_q)


@triton.jit
def _load_lse2(LSE_blk, offs_m, in_q):
    """``lse_i * log2(e)`` for rows ``offs_m`` of a block (those in ``in_q`` exist): (BLOCK_M,) fp32. A row
    that saw no key has ``lse = -inf``; it reads ``+inf`` so that its recomputed ``P = exp2(S - lse2)`` is
    0, not NaN."""
    lse = tl.load(LSE_blk + offs_m, mask=in_q, other=0.0)
    return tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E


@triton.jit
def _causal_query_range(start_n, N_q, OFFSET, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Query rows for key columns ``[start_n, start_n + BLOCK_N)``, in three stages:
    ``[begin, diag_end)`` masked (the diagonal), ``[diag_end, full_end)`` unmasked, ``[full_end, N_q)``
    masked (the ragged last block). Query row r sees key c iff ``r >= c - OFFSET`` (causal); ``begin`` is
    :func:`flashattn_teach.causal.first_visible_row` of ``start_n``, rounded down to a block."""
    n_full = (N_q // BLOCK_M) * BLOCK_M
    if CAUSAL:
        # first row that sees key start_n, rounded down to a block
        begin = (tl.maximum(start_n - OFFSET, 0) // BLOCK_M) * BLOCK_M
        # first block whose every row sees every key of this block: r0 >= start_n + BLOCK_N - 1 - OFFSET
        full_begin = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - OFFSET, 0), BLOCK_M) * BLOCK_M
        diag_end = tl.minimum(full_begin, tl.cdiv(N_q, BLOCK_M) * BLOCK_M)
        diag_end = tl.maximum(diag_end, begin)
    else:
        begin = 0
        diag_end = 0
    full_end = tl.maximum(n_full, diag_end)
    return begin, diag_end, full_end


@triton.jit
def _attn_bwd_dkdv_inner(
    dk,  # dK_j (BLOCK_N, BLOCK_D) fp32 accumulator
    dv,  # dV_j (BLOCK_N, BLOCK_DV) fp32 accumulator
    k,  # K_j (BLOCK_N, BLOCK_D)
    v,  # V_j (BLOCK_N, BLOCK_DV)
    Q_group,  # Q of the group's first query head (row 0), likewise dO, lse and delta
    DO_group,
    LSE_group,
    DELTA_group,
    stride_lse_h,  # the head stride of lse and delta
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
    seed,  # dropout: the key, the group's first (b * H_q + h), N_k, threshold and 1 / (1 - p)
    dropout_offset,
    bh0,
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
    for t in tl.range(0, GROUP * n_steps):
        g = t // tl.maximum(n_steps, 1)
        start = start_m + (t - g * n_steps) * BLOCK_M
        rows = tl.cast(start, tl.int64)
        Q_blk = Q_group + tl.cast(g, tl.int64) * stride_qh + rows * stride_qn
        DO_blk = DO_group + tl.cast(g, tl.int64) * stride_doh + rows * stride_don
        stats = tl.cast(g, tl.int64) * stride_lse_h + rows
        in_q = start + offs_m < N_q
        # Q_i^T: (BLOCK_D, BLOCK_M); dO_i: (BLOCK_M, BLOCK_DV)
        qT = _load_block_T(Q_blk, offs_m, offs_d, stride_qn, stride_qd, in_q, HEAD_DIM, BLOCK_D, ROWS_OK=not MASK)
        do = _load_block(DO_blk, offs_m, offs_dv, stride_don, stride_dod, in_q, HEAD_DIM_V, BLOCK_DV, ROWS_OK=not MASK)
        lse2 = _load_lse2(LSE_group + stats, offs_m, in_q)
        delta = tl.load(DELTA_group + stats + offs_m, mask=in_q, other=0.0)
        if WITH_DK:
            # dP_ij^T = V_j dO_i^T: (BLOCK_N, BLOCK_DV) @ (BLOCK_DV, BLOCK_M) -> (BLOCK_N, BLOCK_M)
            dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
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
                _dropout_keep(seed, dropout_offset, bh0 + g, start + offs_m, offs_n, N_q, N_k, dropout_threshold)
            )
            # dV_j += (P_ij * Z / (1 - p))^T dO_i: (BLOCK_N, BLOCK_M) @ (BLOCK_M, BLOCK_DV)
            if WITH_DV:
                pT_dropped = tl.where(keepT, pT * keep_scale, 0.0)
                dv = tl.dot(pT_dropped.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            if WITH_DK:
                # the gradient reaching P: dP_ij * Z / (1 - p); delta = rowsum(dO * O) is rowsum(P * that)
                dpT = tl.where(keepT, dpT * keep_scale, 0.0)
        elif WITH_DV:
            # dV_j += P_ij^T dO_i: (BLOCK_N, BLOCK_M) @ (BLOCK_M, BLOCK_DV); P cast to dO's dtype for the MMA
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        if WITH_DK:
            # dS_ij^T = P_ij^T * (dP_ij^T - delta_i)
            dsT = pT * (dpT - delta[None, :])
            if SOFTCAP:
                # d(c tanh(x / c)) / dx = 1 - tanh^2: the gradient reaching the scaled score x
                dsT = dsT * (1.0 - tT * tT)
            # dK_j += dS_ij^T Q_i: (BLOCK_N, BLOCK_M) @ (BLOCK_M, BLOCK_D); the scale is applied once at the end
            dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    LSE,
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
):
    """Grid ``(cdiv(N_k, BLOCK_N) * B * H_kv,)``, the key block fastest. ``DK, DV`` have K's and V's shapes
    ``(B, H_kv, N_k, .)``; query heads ``h_kv * GROUP ... h_kv * GROUP + GROUP - 1`` read key head h_kv.
    Variants as in :func:`~.forward._attn_fwd`; ``qk_scale = scale * log2(e)`` here, with its sign."""
    n_blocks = tl.cdiv(N_k, BLOCK_N)
    pid = tl.program_id(0)
    bh = pid // n_blocks
    start_n = (pid % n_blocks) * BLOCK_N
    b = (bh // H_kv).to(tl.int64)
    h_kv = (bh % H_kv).to(tl.int64)
    h0 = h_kv * GROUP  # the group's first query head; its GROUP heads are summed here rather than with atomics
    LSE_group = LSE + (b * H_q + h0) * stride_lse_h  # lse and delta (B, H_q, N_q) contiguous
    DELTA_group = DELTA + (b * H_q + h0) * stride_lse_h
    if VARLEN:
        # as in the forward: N_q, N_k and OFFSET become the sequence's, the bases move to its start rows
        q_start, k_start, N_q, N_k, OFFSET = _sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, OFFSET)
        if start_n >= N_k:
            return  # a key block past this sequence's end
        Q = Q + q_start * stride_qn
        DO = DO + q_start * stride_don
        K = K + k_start * stride_kn
        V = V + k_start * stride_vn
        DK = DK + k_start * stride_dkn
        DV = DV + k_start * stride_dvn
        LSE_group = LSE + h0 * stride_lse_h + q_start  # lse and delta (H_q, total_q)
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

    Q_group = Q + b * stride_qb + h0 * stride_qh
    DO_group = DO + b * stride_dob + h0 * stride_doh
    SLOPES_group = ALIBI_SLOPES + b * stride_slope_b + h0 * stride_slope_h
    MASK_group = ATTN_MASK + b * stride_mask_b + h0 * stride_mask_h
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
        dk, dv, k, v, Q_group, DO_group, LSE_group, DELTA_group, stride_lse_h,
        stride_qh, stride_qn, stride_qd, stride_doh, stride_don, stride_dod, GROUP,
        begin, diag_end, start_n, N_q, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, SLOPES_group, stride_slope_h,
        seed, dropout_offset, b * H_q + h0, N_k, dropout_threshold, keep_scale,
        MASK_group, stride_mask_h, stride_mask_m, stride_mask_n,
        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
        BOOL_MASK, ADD_MASK, DOT_PRECISION,
        WITH_DK, WITH_DV, MASK=True,
    )  # fmt: skip
    dk, dv = _attn_bwd_dkdv_inner(
        dk, dv, k, v, Q_group, DO_group, LSE_group, DELTA_group, stride_lse_h,
        stride_qh, stride_qn, stride_qd, stride_doh, stride_don, stride_dod, GROUP,
        diag_end, full_end, start_n, N_q, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, SLOPES_group, stride_slope_h,
        seed, dropout_offset, b * H_q + h0, N_k, dropout_threshold, keep_scale,
        MASK_group, stride_mask_h, stride_mask_m, stride_mask_n,
        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
        BOOL_MASK, ADD_MASK, DOT_PRECISION,
        WITH_DK, WITH_DV, MASK=False,
    )  # fmt: skip
    dk, dv = _attn_bwd_dkdv_inner(
        dk, dv, k, v, Q_group, DO_group, LSE_group, DELTA_group, stride_lse_h,
        stride_qh, stride_qn, stride_qd, stride_doh, stride_don, stride_dod, GROUP,
        full_end, end, start_n, N_q, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, SLOPES_group, stride_slope_h,
        seed, dropout_offset, b * H_q + h0, N_k, dropout_threshold, keep_scale,
        MASK_group, stride_mask_h, stride_mask_m, stride_mask_n,
        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
        BOOL_MASK, ADD_MASK, DOT_PRECISION,
        WITH_DK, WITH_DV, MASK=True,
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


@triton.jit
def _attn_bwd_dq_inner(
    dq,  # dQ_i (BLOCK_M, BLOCK_D) fp32 accumulator
    q,  # Q_i (BLOCK_M, BLOCK_D)
    do,  # dO_i (BLOCK_M, BLOCK_DV)
    lse2,  # (BLOCK_M,) fp32, lse_i * log2(e)
    delta,  # (BLOCK_M,) fp32, rowsum(dO_i * O_i)
    K_head,  # K and V of the key/value head (row 0)
    V_head,
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
    MASK: tl.constexpr,
):
    """Accumulate key blocks ``[start_n, end_n)`` into ``dQ_i``; ``MASK`` as in :func:`_attn_bwd_dkdv_inner`."""
    rows = tl.arange(0, BLOCK_M)
    offs_m = start_m + rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start in tl.range(start_n, end_n, BLOCK_N):
        cols = tl.cast(start, tl.int64)
        in_k = start + offs_n < N_k
        # K_j^T: (BLOCK_D, BLOCK_N), V_j^T: (BLOCK_DV, BLOCK_N)
        kT = _load_block_T(
            K_head + cols * stride_kn, offs_n, offs_d, stride_kn, stride_kd, in_k, HEAD_DIM, BLOCK_D, ROWS_OK=not MASK
        )
        vT = _load_block_T(
            V_head + cols * stride_vn,
            offs_n,
            offs_dv,
            stride_vn,
            stride_vd,
            in_k,
            HEAD_DIM_V,
            BLOCK_DV,
            ROWS_OK=not MASK,
        )
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
            p = tl.math.exp2(s - lse2[:, None])
        else:
            p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASK or BOOL_MASK:
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
            p = tl.where(visible, p, 0.0)
        # dP_ij = dO_i V_j^T: (BLOCK_M, BLOCK_DV) @ (BLOCK_DV, BLOCK_N); dS_ij = P_ij * (dP_ij - delta_i)
        dp = tl.dot(do, vT, input_precision=DOT_PRECISION)
        if DROPOUT:
            # the gradient reaching P through the forward's keep mask: dP_ij * Z / (1 - p)
            keep = _dropout_keep(seed, dropout_offset, bh, offs_m, start + offs_n, N_q, N_k_all, dropout_threshold)
            dp = tl.where(keep, dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)  # through the softcap's tanh, as in the dK/dV pass
        # dQ_i += dS_ij K_j: (BLOCK_M, BLOCK_N) @ (BLOCK_N, BLOCK_D); the scale is applied once at the end
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(
    Q,
    K,
    V,
    DO,
    LSE,
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
):
    """Grid ``(cdiv(N_q, BLOCK_M) * B * H_q,)``, the query block fastest; causal runs the last (longest)
    query blocks first. ``DQ`` has Q's shape ``(B, H_q, N_q, D)``."""
    n_blocks = tl.cdiv(N_q, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // n_blocks
    blk = pid % n_blocks
    if CAUSAL:
        blk = n_blocks - 1 - blk  # the last query blocks see the most keys: start them first
    start_m = blk * BLOCK_M
    b = (bh // H_q).to(tl.int64)
    h = (bh % H_q).to(tl.int64)
    h_kv = h // GROUP
    stats = bh.to(tl.int64) * stride_lse_h + start_m  # lse and delta are (B, H_q, N_q) contiguous
    if VARLEN:
        # as in the forward: N_q, N_k and OFFSET become the sequence's, the bases move to its start rows
        q_start, k_start, N_q, N_k, OFFSET = _sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, OFFSET)
        if start_m >= N_q:
            return  # a query block past this sequence's end
        Q = Q + q_start * stride_qn
        DO = DO + q_start * stride_don
        DQ = DQ + q_start * stride_dqn
        K = K + k_start * stride_kn
        V = V + k_start * stride_vn
        stats = h * stride_lse_h + q_start + start_m  # lse and delta (H_q, total_q)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_q = start_m + offs_m < N_q
    rows = start_m.to(tl.int64)
    Q_blk = Q + b * stride_qb + h * stride_qh + rows * stride_qn
    DO_blk = DO + b * stride_dob + h * stride_doh + rows * stride_don
    K_head = K + b * stride_kb + h_kv * stride_kh
    V_head = V + b * stride_vb + h_kv * stride_vh
    # Q_i: (BLOCK_M, BLOCK_D), dO_i: (BLOCK_M, BLOCK_DV) and the row statistics, loaded once
    q = _load_block(Q_blk, offs_m, offs_d, stride_qn, stride_qd, in_q, HEAD_DIM, BLOCK_D, ROWS_OK=False)
    do = _load_block(DO_blk, offs_m, offs_dv, stride_don, stride_dod, in_q, HEAD_DIM_V, BLOCK_DV, ROWS_OK=False)
    lse2 = _load_lse2(LSE + stats, offs_m, in_q)
    delta = tl.load(DELTA + stats + offs_m, mask=in_q, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    MASK_head = ATTN_MASK + b * stride_mask_b + h * stride_mask_h
    n_keys = N_k  # the keys that exist for this batch element
    if SEQLENS:
        n_keys = tl.minimum(tl.load(SEQLENS_K + b), N_k)  # keys past this batch element's length are invisible
    if ALIBI:
        slope_log2 = tl.load(ALIBI_SLOPES + b * stride_slope_b + h * stride_slope_h) * LOG2E
    else:
        slope_log2 = 0.0
    # (start_n, end_n, MASK) of the stages: the window's left side, the full key blocks, then the diagonal
    # (the window's right side) and the ragged last block
    if WINDOW:
        begin, full_begin, full_end, end = _window_key_range(start_m, n_keys, OFFSET, LEFT, RIGHT, BLOCK_M, BLOCK_N)
        dq = _attn_bwd_dq_inner(
            dq, q, do, lse2, delta, K_head, V_head, stride_kn, stride_kd, stride_vn, stride_vd,
            begin, full_begin, start_m, n_keys, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, slope_log2,
            seed, dropout_offset, bh, N_q, N_k, dropout_threshold, keep_scale,
            MASK_head, stride_mask_m, stride_mask_n,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
            BOOL_MASK, ADD_MASK, DOT_PRECISION,
            MASK=True,
        )  # fmt: skip
    else:
        full_begin = 0
        full_end, end = _causal_key_range(start_m, n_keys, OFFSET, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse2, delta, K_head, V_head, stride_kn, stride_kd, stride_vn, stride_vd,
        full_begin, full_end, start_m, n_keys, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, slope_log2,
        seed, dropout_offset, bh, N_q, N_k, dropout_threshold, keep_scale,
        MASK_head, stride_mask_m, stride_mask_n,
        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
        BOOL_MASK, ADD_MASK, DOT_PRECISION,
        MASK=False,
    )  # fmt: skip
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse2, delta, K_head, V_head, stride_kn, stride_kd, stride_vn, stride_vd,
        full_end, end, start_m, n_keys, qk_scale, OFFSET, LEFT, RIGHT, softcap_log2, slope_log2,
        seed, dropout_offset, bh, N_q, N_k, dropout_threshold, keep_scale,
        MASK_head, stride_mask_m, stride_mask_n,
        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT,
        BOOL_MASK, ADD_MASK, DOT_PRECISION,
        MASK=True,
    )  # fmt: skip

    # dQ_i = scale * sum_j dS_ij K_j
    dq = dq * scale
    DQ_blk = DQ + b * stride_dqb + h * stride_dqh + rows * stride_dqn
    _store_block(DQ_blk, dq.to(DQ.dtype.element_ty), offs_m, offs_d, stride_dqn, stride_dqd, in_q, HEAD_DIM)
