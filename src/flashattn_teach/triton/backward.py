"""The memory-efficient backward in Triton (Dao 2023, FlashAttention-2 Alg. 2), as three kernels.

Forward saved ``q, k, v, O`` and ``lse``; the probabilities are recomputed tile by tile:

    delta_i = rowsum(dO_i * O_i)                  _attn_bwd_preprocess   (Alg. 2 line 4)
    P_ij    = exp(S_ij - lse_i)                   recomputed in both passes below
    dV_j    = sum_i P_ij^T dO_i                   _attn_bwd_dkdv: a program owns key block j
    dS_ij   = P_ij * (dO_i V_j^T - delta_i)
    dK_j    = scale * sum_i dS_ij^T Q_i
    dQ_i    = scale * sum_j dS_ij K_j             _attn_bwd_dq: a program owns query block i

Each output block is written by exactly one program, so there are no atomics and the result is bitwise
the same on every run. With grouped-query attention the dK/dV program of a key/value head loops over
its ``GROUP`` query heads too, summing their contributions in registers.

As in the forward, exponentials run in base 2 (``qk_scale = scale * log2(e)``, ``lse2 = lse * log2(e)``),
and causal masking splits each loop into stages that run with and without a mask. A query row that saw
no key has ``lse = -inf``; it is read as ``+inf`` so that its recomputed ``P`` is 0 rather than NaN.
"""

from __future__ import annotations

import triton
from triton import language as tl

from .forward import LOG2E, _causal_key_range, _load_tile, _load_tile_T, _store_tile


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
    """Grid ``(cdiv(N_q, BLOCK_M), B * H_q)``; ``DELTA (B, H_q, N_q)`` contiguous fp32."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_q).to(tl.int64)
    h = (pid_bh % H_q).to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_q = offs_m < N_q
    O_head = O + b * stride_ob + h * stride_oh
    DO_head = DO + b * stride_dob + h * stride_doh
    # O_i, dO_i: (BLOCK_M, BLOCK_DV), in fp32 so that the row sum accumulates in fp32
    o = _load_tile(O_head, offs_m, offs_dv, stride_on, stride_od, in_q, HEAD_DIM_V).to(tl.float32)
    do = _load_tile(DO_head, offs_m, offs_dv, stride_don, stride_dod, in_q, HEAD_DIM_V).to(tl.float32)
    # delta_i = rowsum(dO_i * O_i), which equals rowsum(P_ij * dP_ij) summed over all key blocks j
    tl.store(DELTA + pid_bh.to(tl.int64) * N_q + offs_m, tl.sum(o * do, 1), mask=in_q)


@triton.jit
def _load_lse2(LSE_head, offs_m, in_q):
    """``lse_i * log2(e)`` for rows ``offs_m`` (those in ``in_q`` exist): (BLOCK_M,) fp32. A row that saw no
    key has ``lse = -inf``; it reads ``+inf`` so that its recomputed ``P = exp2(S - lse2)`` is 0, not NaN."""
    lse = tl.load(LSE_head + offs_m, mask=in_q, other=0.0)
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
    Q_head,
    DO_head,
    LSE_head,
    DELTA_head,
    stride_qn,
    stride_qd,
    stride_don,
    stride_dod,
    start_m,
    end_m,
    offs_n,
    N_q,
    qk_scale,
    OFFSET,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MASK: tl.constexpr,
):
    """Accumulate query blocks ``[start_m, end_m)`` of one query head into ``dK_j, dV_j``.

    Works on transposed tiles (keys along rows) so that no probability tile needs a transpose. ``MASK``
    selects the stage: True for the diagonal and the ragged last block, where ``P`` of invisible pairs is 0.
    """
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start in tl.range(start_m, end_m, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        in_q = offs_m < N_q
        # Q_i^T: (BLOCK_D, BLOCK_M); dO_i: (BLOCK_M, BLOCK_DV)
        qT = _load_tile_T(Q_head, offs_m, offs_d, stride_qn, stride_qd, in_q, HEAD_DIM)
        do = _load_tile(DO_head, offs_m, offs_dv, stride_don, stride_dod, in_q, HEAD_DIM_V)
        lse2 = _load_lse2(LSE_head, offs_m, in_q)
        delta = tl.load(DELTA_head + offs_m, mask=in_q, other=0.0)
        # S_ij^T = K_j Q_i^T: (BLOCK_N, BLOCK_D) @ (BLOCK_D, BLOCK_M) -> (BLOCK_N, BLOCK_M)
        qkT = tl.dot(k, qT, input_precision=DOT_PRECISION) * qk_scale
        # P_ij^T = exp(S_ij^T - lse_i)
        pT = tl.math.exp2(qkT - lse2[None, :])
        if MASK:
            visible = in_q[None, :]
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= offs_m[None, :] + OFFSET)
            pT = tl.where(visible, pT, 0.0)
        # dV_j += P_ij^T dO_i: (BLOCK_N, BLOCK_M) @ (BLOCK_M, BLOCK_DV); P cast to dO's dtype for the MMA
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        # dP_ij^T = V_j dO_i^T: (BLOCK_N, BLOCK_DV) @ (BLOCK_DV, BLOCK_M) -> (BLOCK_N, BLOCK_M)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        # dS_ij^T = P_ij^T * (dP_ij^T - delta_i)
        dsT = pT * (dpT - delta[None, :])
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
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(N_k, BLOCK_N), B * H_kv)``. ``DK, DV`` have K's and V's shapes ``(B, H_kv, N_k, .)``."""
    start_n = tl.program_id(0) * BLOCK_N
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_kv).to(tl.int64)
    h_kv = (pid_bh % H_kv).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_k = offs_n < N_k
    K_head = K + b * stride_kb + h_kv * stride_kh
    V_head = V + b * stride_vb + h_kv * stride_vh
    # K_j: (BLOCK_N, BLOCK_D), V_j: (BLOCK_N, BLOCK_DV), loaded once
    k = _load_tile(K_head, offs_n, offs_d, stride_kn, stride_kd, in_k, HEAD_DIM)
    v = _load_tile(V_head, offs_n, offs_dv, stride_vn, stride_vd, in_k, HEAD_DIM_V)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    begin, diag_end, full_end = _causal_query_range(start_n, N_q, OFFSET, BLOCK_M, BLOCK_N, CAUSAL)
    # The GROUP query heads that read this key/value head, summed here rather than with atomics.
    for g in range(GROUP):
        h = h_kv * GROUP + g
        Q_head = Q + b * stride_qb + h * stride_qh
        DO_head = DO + b * stride_dob + h * stride_doh
        LSE_head = LSE + (b * H_q + h) * N_q
        DELTA_head = DELTA + (b * H_q + h) * N_q
        dk, dv = _attn_bwd_dkdv_inner(
            dk,
            dv,
            k,
            v,
            Q_head,
            DO_head,
            LSE_head,
            DELTA_head,
            stride_qn,
            stride_qd,
            stride_don,
            stride_dod,
            begin,
            diag_end,
            offs_n,
            N_q,
            qk_scale,
            OFFSET,
            HEAD_DIM,
            HEAD_DIM_V,
            BLOCK_D,
            BLOCK_DV,
            BLOCK_M,
            CAUSAL,
            DOT_PRECISION,
            MASK=True,
        )
        dk, dv = _attn_bwd_dkdv_inner(
            dk,
            dv,
            k,
            v,
            Q_head,
            DO_head,
            LSE_head,
            DELTA_head,
            stride_qn,
            stride_qd,
            stride_don,
            stride_dod,
            diag_end,
            full_end,
            offs_n,
            N_q,
            qk_scale,
            OFFSET,
            HEAD_DIM,
            HEAD_DIM_V,
            BLOCK_D,
            BLOCK_DV,
            BLOCK_M,
            CAUSAL,
            DOT_PRECISION,
            MASK=False,
        )
        dk, dv = _attn_bwd_dkdv_inner(
            dk,
            dv,
            k,
            v,
            Q_head,
            DO_head,
            LSE_head,
            DELTA_head,
            stride_qn,
            stride_qd,
            stride_don,
            stride_dod,
            full_end,
            N_q,
            offs_n,
            N_q,
            qk_scale,
            OFFSET,
            HEAD_DIM,
            HEAD_DIM_V,
            BLOCK_D,
            BLOCK_DV,
            BLOCK_M,
            CAUSAL,
            DOT_PRECISION,
            MASK=True,
        )

    # dK_j = scale * sum_i dS_ij^T Q_i
    dk = dk * scale
    # each output pointer is formed just before its store: one fewer 64-bit register live at the peak
    DK_head = DK + b * stride_dkb + h_kv * stride_dkh
    _store_tile(DK_head, dk.to(DK.dtype.element_ty), offs_n, offs_d, stride_dkn, stride_dkd, in_k, HEAD_DIM)
    DV_head = DV + b * stride_dvb + h_kv * stride_dvh
    _store_tile(DV_head, dv.to(DV.dtype.element_ty), offs_n, offs_dv, stride_dvn, stride_dvd, in_k, HEAD_DIM_V)


@triton.jit
def _attn_bwd_dq_inner(
    dq,  # dQ_i (BLOCK_M, BLOCK_D) fp32 accumulator
    q,  # Q_i (BLOCK_M, BLOCK_D)
    do,  # dO_i (BLOCK_M, BLOCK_DV)
    lse2,  # (BLOCK_M,) fp32, lse_i * log2(e)
    delta,  # (BLOCK_M,) fp32, rowsum(dO_i * O_i)
    K_head,
    V_head,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    start_n,
    end_n,
    offs_m,
    N_k,
    qk_scale,
    OFFSET,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MASK: tl.constexpr,
):
    """Accumulate key blocks ``[start_n, end_n)`` into ``dQ_i``; ``MASK`` as in :func:`_attn_bwd_dkdv_inner`."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start in tl.range(start_n, end_n, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        in_k = offs_n < N_k
        # K_j^T: (BLOCK_D, BLOCK_N), V_j^T: (BLOCK_DV, BLOCK_N)
        kT = _load_tile_T(K_head, offs_n, offs_d, stride_kn, stride_kd, in_k, HEAD_DIM)
        vT = _load_tile_T(V_head, offs_n, offs_dv, stride_vn, stride_vd, in_k, HEAD_DIM_V)
        # S_ij = Q_i K_j^T: (BLOCK_M, BLOCK_D) @ (BLOCK_D, BLOCK_N); P_ij = exp(S_ij - lse_i)
        qk = tl.dot(q, kT, input_precision=DOT_PRECISION) * qk_scale
        p = tl.math.exp2(qk - lse2[:, None])
        if MASK:
            visible = in_k[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + OFFSET)
            p = tl.where(visible, p, 0.0)
        # dP_ij = dO_i V_j^T: (BLOCK_M, BLOCK_DV) @ (BLOCK_DV, BLOCK_N); dS_ij = P_ij * (dP_ij - delta_i)
        dp = tl.dot(do, vT, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
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
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(N_q, BLOCK_M), B * H_q)``. ``DQ`` has Q's shape ``(B, H_q, N_q, D)``."""
    start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_q).to(tl.int64)
    h = (pid_bh % H_q).to(tl.int64)
    h_kv = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_q = offs_m < N_q
    Q_head = Q + b * stride_qb + h * stride_qh
    DO_head = DO + b * stride_dob + h * stride_doh
    K_head = K + b * stride_kb + h_kv * stride_kh
    V_head = V + b * stride_vb + h_kv * stride_vh
    # Q_i: (BLOCK_M, BLOCK_D), dO_i: (BLOCK_M, BLOCK_DV) and the row statistics, loaded once
    q = _load_tile(Q_head, offs_m, offs_d, stride_qn, stride_qd, in_q, HEAD_DIM)
    do = _load_tile(DO_head, offs_m, offs_dv, stride_don, stride_dod, in_q, HEAD_DIM_V)
    lse2 = _load_lse2(LSE + pid_bh.to(tl.int64) * N_q, offs_m, in_q)
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * N_q + offs_m, mask=in_q, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    full_end, end = _causal_key_range(start_m, N_k, OFFSET, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _attn_bwd_dq_inner(
        dq,
        q,
        do,
        lse2,
        delta,
        K_head,
        V_head,
        stride_kn,
        stride_kd,
        stride_vn,
        stride_vd,
        0,
        full_end,
        offs_m,
        N_k,
        qk_scale,
        OFFSET,
        HEAD_DIM,
        HEAD_DIM_V,
        BLOCK_D,
        BLOCK_DV,
        BLOCK_N,
        CAUSAL,
        DOT_PRECISION,
        MASK=False,
    )
    dq = _attn_bwd_dq_inner(
        dq,
        q,
        do,
        lse2,
        delta,
        K_head,
        V_head,
        stride_kn,
        stride_kd,
        stride_vn,
        stride_vd,
        full_end,
        end,
        offs_m,
        N_k,
        qk_scale,
        OFFSET,
        HEAD_DIM,
        HEAD_DIM_V,
        BLOCK_D,
        BLOCK_DV,
        BLOCK_N,
        CAUSAL,
        DOT_PRECISION,
        MASK=True,
    )

    # dQ_i = scale * sum_j dS_ij K_j
    dq = dq * scale
    DQ_head = DQ + b * stride_dqb + h * stride_dqh
    _store_tile(DQ_head, dq.to(DQ.dtype.element_ty), offs_m, offs_d, stride_dqn, stride_dqd, in_q, HEAD_DIM)
