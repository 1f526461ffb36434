"""Changes from core/kernel.py (the backward): a one-kernel form with atomic dQ beside the two-pass one, grouped
heads, the mask contract's variants (softcap's ``1 - tanh^2`` on ``dS``), dropout and sinks.

The memory-efficient backward in Triton (Dao 2023, FlashAttention-2 Alg. 2), in two forms.

Forward saved ``q, k, v, O`` and ``lse``; the probabilities are recomputed tile by tile:

    delta_i = rowsum(dO_i * O_i)                  attn_bwd_preprocess (Alg. 2 line 4; also lse_i * log2(e))
    P_ij    = exp(S_ij - lse_i)                   recomputed in both passes below
    dV_j    = sum_i P_ij^T dO_i                   attn_bwd_dkdv (backward_dkdv.py): a program owns key block j
    dS_ij   = P_ij * (dO_i V_j^T - delta_i)
    dK_j    = scale * sum_i dS_ij^T Q_i
    dQ_i    = scale * sum_j dS_ij K_j             attn_bwd_dq (backward_dq.py): a program owns query block i

The default is one kernel after the preprocess, as in FA2 and FA3: ``attn_bwd_dkdv`` with ``DQ_ATOMIC``
also adds each step's ``scale dS_ij K_j`` into a float32 dQ buffer by atomic adds (Alg. 2 line 21), so
``S``, ``P``, ``dP`` and ``dS`` are computed once per pair: five matrix products where the two passes need
seven. The adds from different key blocks reach a row in an order that varies from run to run, and so does
the rounding of their sum. The deterministic form, ``attn_bwd_dkdv`` then ``attn_bwd_dq``, recomputes P and
dS in the dQ pass instead: each output block is written by exactly one program, no atomics, and the result
is bitwise the same on every run. With grouped-query attention the dK/dV program of a key/value head also visits
its ``GROUP`` query heads, in one flat loop over (query head, query block) pairs: a nested head loop
would keep the inner loop's pipeline state alive across heads and cost registers that the tile needs.

As in the forward, exponentials run in base 2 (``qk_scale = scale * log2(e)``, ``lse2 = lse * log2(e)``,
written by the preprocess), and causal masking splits each loop into stages that run with and without a
mask. A query row that saw no key has ``lse = -inf``; its ``lse2`` is ``+inf`` so that its recomputed
``P`` is 0 rather than NaN.

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

from .forward import LOG2E
from .tiles import _load_block


@triton.jit
def attn_bwd_preprocess(
    O,
    DO,
    LSE,
    row_stats,
    H_q,
    N_q,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Grid ``(cdiv(N_q, BLOCK_M) * B * H_q,)``; ``O, DO`` are :class:`~.records.Strided`; ``LSE`` (read)
    and ``row_stats`` (:class:`~.records.RowStats`: delta and lse2, written) are ``(B, H_q, N_q)``
    contiguous fp32.

    Writes ``delta_i = rowsum(dO_i * O_i)`` and ``lse2_i = lse_i * log2(e)``, the statistic both loops
    subtract from a log2-unit score. A row that saw no key has ``lse = -inf``; its ``lse2`` is ``+inf``, so
    that its recomputed ``P = exp2(S - lse2)`` is 0, not NaN. Done here once per row rather than in the
    dK/dV loop, where each warp would redo it for every score column of every step."""
    n_blocks = tl.cdiv(N_q, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // n_blocks
    start_m = (pid % n_blocks) * BLOCK_M
    b = (bh // H_q).to(tl.int64)
    h = (bh % H_q).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_q = start_m + offs_m < N_q
    O_blk = O.ptr + b * O.stride_b + h * O.stride_h + start_m.to(tl.int64) * O.stride_n
    DO_blk = DO.ptr + b * DO.stride_b + h * DO.stride_h + start_m.to(tl.int64) * DO.stride_n
    # O_i, dO_i: (BLOCK_M, BLOCK_DV)
    o = _load_block(O_blk, offs_m, offs_dv, O.stride_n, O.stride_d, in_q, HEAD_DIM_V, BLOCK_DV, ROWS_OK=False)
    do = _load_block(DO_blk, offs_m, offs_dv, DO.stride_n, DO.stride_d, in_q, HEAD_DIM_V, BLOCK_DV, ROWS_OK=False)
    # delta_i = rowsum(dO_i * O_i), in fp32; it equals rowsum(P_ij * dP_ij) summed over all key blocks j
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    rows = bh.to(tl.int64) * N_q + start_m + offs_m
    tl.store(row_stats.delta + rows, delta, mask=in_q)
    lse = tl.load(LSE + rows, mask=in_q, other=0.0)
    tl.store(row_stats.lse2 + rows, tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E, mask=in_q)


@triton.jit
def _causal_query_range(start_n, N_q, OFFSET, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Query rows for key columns ``[start_n, start_n + BLOCK_N)``, in three stages:
    ``[begin, diag_end)`` masked (the diagonal), ``[diag_end, full_end)`` unmasked, ``[full_end, N_q)``
    masked (the ragged last block). Query row r sees key c iff ``r >= c - OFFSET`` (causal); ``begin`` is
    :func:`flashattn_teach.masks.causal.first_visible_row` of ``start_n``, rounded down to a block."""
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
