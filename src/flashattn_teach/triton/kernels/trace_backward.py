"""The backward's trace build (issue 39): with ``TRACE`` the dK/dV and dQ kernels write, for the one head the host
selects, each step's state into a float32 trace buffer, so the replay can show the kernel's own numbers.

The buffer (host side :mod:`flashattn_teach.triton.trace_backward`, which lays it out and reads it) is flat:

    header (8)    [b, h, the atomic adds' counter, T_r, T_c, start of the dK/dV records, of the dQ partials,
                   of the dQ records], written by the host (the counter starts at 0)
    dK/dV         per (j, i), BLOCK_N key rows of [P_ij^T (BLOCK_M) | dP_ij^T | dS_ij^T | dK_j (BLOCK_D) | dV_j]
    dQ partials   per (j, i), one-kernel backward: BLOCK_M rows of [scale dS_ij K_j (BLOCK_D) | order]
    dQ            per (i, j), the dQ kernel: BLOCK_M rows of [P_ij (BLOCK_N) | dP_ij | dS_ij | dS_ij K_j | dQ_i]

each after the step, in the kernel's units: ``dS`` is the MMA's operand (cast to the inputs' dtype; in the
one-kernel backward it comes scaled), ``dK_j`` and ``dQ_i`` are unscaled in the two-kernel backward (the scale
is applied once at the end), ``order`` is the counter read by an atomic add right after the partial's own adds
(0, 1, 2, ...: the order the programs' partials reached dQ). Offsets fit float32 exactly: the host keeps the
buffer under 2^24 elements. With ``TRACE`` off none of this is compiled: ``row_stats.trace`` is None.
"""

from __future__ import annotations

import triton
from triton import language as tl

HEADER = tl.constexpr(8)  # the header's length, in float32


@triton.jit
def _header(Trace, n):
    """Header entry ``n`` as an int32 (the host wrote small integers as float32, exactly)."""
    return tl.load(Trace + n).to(tl.int32)


@triton.jit
def _selected(Trace, b, h):
    """Whether ``(b, h)`` is the head whose program the host asked to trace (header entries 0 and 1)."""
    return (b == _header(Trace, 0)) & (h == _header(Trace, 1))


@triton.jit
def _store_columns(rec, W, col0, tile) -> None:
    """``tile (R, C)`` into columns ``[col0, col0 + C)`` of the records' rows ``rec + r * W``."""
    R: tl.constexpr = tile.shape[0]
    C: tl.constexpr = tile.shape[1]
    tl.store(rec + tl.arange(0, R)[:, None] * W + col0 + tl.arange(0, C)[None, :], tile.to(tl.float32))


@triton.jit
def _trace_dkdv(Trace, b, h, i, j, pT, dpT, dsT, dk, dv, dq) -> None:
    """The dK/dV program's step ``(j, i)`` after its update: ``P^T, dP^T, dS^T (BLOCK_N, BLOCK_M)``, ``dK_j
    (BLOCK_N, BLOCK_D)``, ``dV_j (BLOCK_N, BLOCK_DV)``; with the one-kernel backward also its dQ partial ``dq
    (BLOCK_M, BLOCK_D)`` (else None) and the order it reached dQ."""
    if _selected(Trace, b, h):
        BLOCK_N: tl.constexpr = pT.shape[0]
        BLOCK_M: tl.constexpr = pT.shape[1]
        BLOCK_D: tl.constexpr = dk.shape[1]
        W: tl.constexpr = 3 * BLOCK_M + BLOCK_D + dv.shape[1]
        at = j * _header(Trace, 3) + i  # record (j, i) of a (T_c, T_r) grid
        rec = Trace + _header(Trace, 5) + at.to(tl.int64) * (BLOCK_N * W)
        _store_columns(rec, W, 0, pT)
        _store_columns(rec, W, BLOCK_M, dpT)
        _store_columns(rec, W, 2 * BLOCK_M, dsT)
        _store_columns(rec, W, 3 * BLOCK_M, dk)
        _store_columns(rec, W, 3 * BLOCK_M + BLOCK_D, dv)
        if dq is not None:
            order = tl.atomic_add(Trace + 2, 1.0, sem="relaxed")  # after this partial's adds: its place among them
            W_dq: tl.constexpr = BLOCK_D + 1
            part = Trace + _header(Trace, 6) + at.to(tl.int64) * (BLOCK_M * W_dq)
            _store_columns(part, W_dq, 0, dq)
            tl.store(part + tl.arange(0, BLOCK_M) * W_dq + BLOCK_D, tl.zeros([BLOCK_M], tl.float32) + order)


@triton.jit
def _trace_dq(Trace, b, h, i, j, p, dp, ds, part, dq) -> None:
    """The dQ program's step ``(i, j)`` after its update: ``P, dP, dS (BLOCK_M, BLOCK_N)``, the step's ``dS_ij
    K_j`` and ``dQ_i (BLOCK_M, BLOCK_D)``, both unscaled."""
    if _selected(Trace, b, h):
        BLOCK_M: tl.constexpr = p.shape[0]
        BLOCK_N: tl.constexpr = p.shape[1]
        W: tl.constexpr = 3 * BLOCK_N + 2 * dq.shape[1]
        at = i * _header(Trace, 4) + j  # record (i, j) of a (T_r, T_c) grid
        rec = Trace + _header(Trace, 7) + at.to(tl.int64) * (BLOCK_M * W)
        _store_columns(rec, W, 0, p)
        _store_columns(rec, W, BLOCK_N, dp)
        _store_columns(rec, W, 2 * BLOCK_N, ds)
        _store_columns(rec, W, 3 * BLOCK_N, part)
        _store_columns(rec, W, 3 * BLOCK_N + dq.shape[1], dq)
