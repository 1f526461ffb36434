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

from .forward import _causal_key_range

LOG2E = tl.constexpr(1.4426950408889634)  # 1 / ln(2)


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
    mask = (offs_m[:, None] < N_q) & (offs_dv[None, :] < HEAD_DIM_V)
    o = tl.load(
        O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_dv[None, :] * stride_od,
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don + offs_dv[None, :] * stride_dod,
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    # delta_i = rowsum(dO_i * O_i), which equals rowsum(P_ij * dP_ij) summed over all key blocks j
    tl.store(DELTA + pid_bh.to(tl.int64) * N_q + offs_m, tl.sum(o * do, 1), mask=offs_m < N_q)


@triton.jit
def _causal_query_range(start_n, N_q, OFFSET, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Query rows for key columns ``[start_n, start_n + BLOCK_N)``, in three stages:
    ``[begin, diag_end)`` masked (the diagonal), ``[diag_end, full_end)`` unmasked, ``[full_end, N_q)``
    masked (the ragged last block). Query row r sees key c iff ``r >= c - OFFSET`` (causal)."""
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
    dk,
    dv,
    k,
    v,  # dK_j, dV_j (BLOCK_N, BLOCK_D / BLOCK_DV) fp32 accumulators; K_j, V_j tiles
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
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Accumulate query blocks ``[start_m, end_m)`` of one query head into ``dK_j, dV_j``.

    Works on transposed tiles (keys along rows) so that no probability tile needs a transpose.
    """
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start in tl.range(start_m, end_m, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        in_q = offs_m < N_q
        # Q_i^T: (BLOCK_D, BLOCK_M); dO_i: (BLOCK_M, BLOCK_DV); rows past N_q load as 0
        qT = tl.load(
            Q_head + offs_m[None, :] * stride_qn + offs_d[:, None] * stride_qd,
            mask=in_q[None, :] & (offs_d[:, None] < HEAD_DIM),
            other=0.0,
        )
        do = tl.load(
            DO_head + offs_m[:, None] * stride_don + offs_dv[None, :] * stride_dod,
            mask=in_q[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
            other=0.0,
        )
        lse = tl.load(LSE_head + offs_m, mask=in_q, other=0.0)
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
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
    # K_j: (BLOCK_N, BLOCK_D), V_j: (BLOCK_N, BLOCK_DV), loaded once
    k = tl.load(
        K + b * stride_kb + h_kv * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
        mask=in_k[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    v = tl.load(
        V + b * stride_vb + h_kv * stride_vh + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
        mask=in_k[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
        other=0.0,
    )
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
            True,
            CAUSAL,
            DOT_PRECISION,
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
            False,
            CAUSAL,
            DOT_PRECISION,
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
            True,
            CAUSAL,
            DOT_PRECISION,
        )

    # dK_j = scale * sum_i dS_ij^T Q_i
    dk = dk * scale
    tl.store(
        DK + b * stride_dkb + h_kv * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
        dk.to(DK.dtype.element_ty),
        mask=in_k[:, None] & (offs_d[None, :] < HEAD_DIM),
    )
    tl.store(
        DV + b * stride_dvb + h_kv * stride_dvh + offs_n[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd,
        dv.to(DV.dtype.element_ty),
        mask=in_k[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
    )


@triton.jit
def _attn_bwd_dq_inner(
    dq,
    q,
    do,
    lse2,
    delta,  # dQ_i (BLOCK_M, BLOCK_D) fp32 accumulator; Q_i, dO_i tiles; per-row stats
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
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Accumulate key blocks ``[start_n, end_n)`` into ``dQ_i``."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start in tl.range(start_n, end_n, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        in_k = offs_n < N_k
        # K_j^T: (BLOCK_D, BLOCK_N), V_j^T: (BLOCK_DV, BLOCK_N)
        kT = tl.load(
            K_head + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
            mask=in_k[None, :] & (offs_d[:, None] < HEAD_DIM),
            other=0.0,
        )
        vT = tl.load(
            V_head + offs_n[None, :] * stride_vn + offs_dv[:, None] * stride_vd,
            mask=in_k[None, :] & (offs_dv[:, None] < HEAD_DIM_V),
            other=0.0,
        )
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
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
        mask=in_q[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don + offs_dv[None, :] * stride_dod,
        mask=in_q[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
        other=0.0,
    )
    lse = tl.load(LSE + pid_bh.to(tl.int64) * N_q + offs_m, mask=in_q, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * N_q + offs_m, mask=in_q, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    K_head = K + b * stride_kb + h_kv * stride_kh
    V_head = V + b * stride_vb + h_kv * stride_vh
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
        False,
        CAUSAL,
        DOT_PRECISION,
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
        True,
        CAUSAL,
        DOT_PRECISION,
    )

    # dQ_i = scale * sum_j dS_ij K_j
    dq = dq * scale
    tl.store(
        DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqn + offs_d[None, :] * stride_dqd,
        dq.to(DQ.dtype.element_ty),
        mask=in_q[:, None] & (offs_d[None, :] < HEAD_DIM),
    )
