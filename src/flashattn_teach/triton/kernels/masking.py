"""The mask contract of :mod:`flashattn_teach.masks` inside the kernels: which tiles a loop visits, which
elements of a visited tile are visible, and what softcap and ALiBi do to a score.

Each variant sits behind a ``tl.constexpr`` flag of the kernels (``WINDOW``, ``SOFTCAP``, ``ALIBI``,
``SEQLENS``), so a kernel without it compiles to the code it had before the variant existed.

Window, flash-attn's meaning with causal folded in as ``RIGHT = 0``: query row i sees key j iff

    i + OFFSET - LEFT <= j <= i + OFFSET + RIGHT        (an open side is passed as variants.UNBOUNDED)

Both bounds grow with i, so the key blocks a query block ``[start_m, start_m + BLOCK_M)`` meets split into
three runs (and the query blocks a key block meets, likewise):

    [begin, full_begin)        masked: some row's left bound cuts the block
    [full_begin, full_end)     unmasked: every row sees every key (a FULL tile of masks.py)
    [full_end, end)            masked: the right bound, the ragged last block
    outside [begin, end)       never visited (SKIP)

Packed sequences (``VARLEN``): the grid's batch index is the sequence b, and :func:`_sequence` gives its
start rows, its lengths (which take the place of ``N_q, N_k``) and its ``OFFSET``; every range above is
then in the sequence's own coordinates, as the window and the ALiBi distance are (:mod:`flashattn_teach.masks.packed`).

``seqlens_k`` needs no range function of its own: a program reads ``L_b = seqlens_k[b]`` and uses it in
place of ``N_k`` for its key bounds, and its diagonal offset is ``OFFSET * (L_b - N_q)`` (the launcher
passes ``OFFSET`` = 1 for bottom-right alignment, 0 for top-left, as for packed sequences): flash-attn
aligns the causal diagonal, the window and the ALiBi distance to each batch element's own length.

Scores reach the modifiers in log2 units, ``s2 = scale * log2(e) * q.k``, and leave in them:

    softcap:  s2 = c2 * tanh(s2 / c2),       c2 = softcap * log2(e) (the cap in the same units)
    ALiBi:    s2 -= slope * log2(e) * |i + OFFSET - j|
    additive attn_mask:  s2 += log2(e) * attn_mask[b, h, i, j]

A user ``attn_mask`` (``BOOL_MASK`` or ``ADD_MASK``) is read tile by tile through its strides, 0 along
broadcast dims, so nothing ``N_q x N_k`` is built beyond the user's own mask; every visited tile is then
handled as a masked one (its rows may see none of its keys).
"""

from __future__ import annotations

import triton
from triton import language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # 1 / ln 2: exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # ln 2: log(x) = log2(x) * LN2


@triton.jit
def _window_key_range(start_m, N_k, OFFSET, LEFT, RIGHT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(begin, full_begin, full_end, end)``: the key columns of query rows ``[start_m, start_m + BLOCK_M)``
    under the window, keys ``>= N_k`` invisible; ``begin`` is a multiple of BLOCK_N unless the range is empty."""
    # one past the last row's right bound
    end = tl.minimum(tl.maximum(start_m + BLOCK_M + OFFSET + RIGHT, 0), N_k)
    # the first row's left bound, rounded down to a block; past ``end`` no row sees anything: an empty range
    first = tl.maximum(start_m + OFFSET - LEFT, 0)
    begin = tl.where(first < end, (first // BLOCK_N) * BLOCK_N, end)
    # a block [c0, c0 + BLOCK_N) is within every row's left bound iff c0 >= (start_m + BLOCK_M - 1) + OFFSET - LEFT
    full_begin = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + OFFSET - LEFT, 0), BLOCK_N) * BLOCK_N
    full_begin = tl.minimum(full_begin, end)
    # ... and within every row's right bound iff c0 + BLOCK_N - 1 <= start_m + OFFSET + RIGHT, all keys < N_k
    full_end = (tl.minimum(tl.maximum(start_m + OFFSET + RIGHT + 1, 0), N_k) // BLOCK_N) * BLOCK_N
    return begin, full_begin, tl.maximum(full_end, full_begin), end


@triton.jit
def _window_query_range(start_n, N_q, OFFSET, LEFT, RIGHT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(begin, full_begin, full_end, end)``: the query rows that see keys ``[start_n, start_n + BLOCK_N)``
    under the window (key j is seen by rows ``j - OFFSET - RIGHT <= i <= j - OFFSET + LEFT``); the unmasked
    run holds whole blocks of existing rows only."""
    # one past the last key's last row
    end = tl.minimum(tl.maximum(start_n + BLOCK_N - OFFSET + LEFT, 0), N_q)
    # the first key's first row, rounded down to a block (past ``end``: an empty range)
    first = tl.maximum(start_n - OFFSET - RIGHT, 0)
    begin = tl.where(first < end, (first // BLOCK_M) * BLOCK_M, end)
    # a block [r0, r0 + BLOCK_M) sees the last key (right bound) iff r0 >= start_n + BLOCK_N - 1 - OFFSET - RIGHT
    full_begin = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - OFFSET - RIGHT, 0), BLOCK_M) * BLOCK_M
    full_begin = tl.minimum(full_begin, end)
    # ... and its last row sees the first key (left bound) iff r0 + BLOCK_M - 1 <= start_n - OFFSET + LEFT
    full_end = (tl.minimum(tl.maximum(start_n - OFFSET + LEFT + 1, 0), N_q) // BLOCK_M) * BLOCK_M
    return begin, full_begin, tl.maximum(full_end, full_begin), end


@triton.jit
def _sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, BOTTOM_RIGHT):
    """``(q_start, k_start, N_q, N_k, OFFSET)`` of packed sequence ``b``: its first query and key rows on
    the packed axis (64-bit, to move base pointers), its lengths, and its diagonal offset (``N_k - N_q``
    when ``BOTTOM_RIGHT`` is 1, 0 when it is 0: flash-attn's per-sequence causal alignment)."""
    q_start = tl.load(CU_SEQLENS_Q + b)
    k_start = tl.load(CU_SEQLENS_K + b)
    N_q = tl.load(CU_SEQLENS_Q + b + 1) - q_start
    N_k = tl.load(CU_SEQLENS_K + b + 1) - k_start
    return q_start.to(tl.int64), k_start.to(tl.int64), N_q, N_k, BOTTOM_RIGHT * (N_k - N_q)


@triton.jit
def _in_window(rows, cols, OFFSET, LEFT, RIGHT):
    """Row ``rows`` sees key ``cols`` under the window (broadcast index tensors)."""
    diagonal = rows + OFFSET
    return (cols >= diagonal - LEFT) & (cols <= diagonal + RIGHT)


@triton.jit
def _tanh(x):
    """``tanh(x) = 1 - 2 / (exp(2x) + 1)``: one exponential and a division; +-1 (not NaN) where exp
    overflows or underflows."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _modify_scores(s, rows, cols, OFFSET, softcap_log2, slope_log2, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """``(s2', t)``: log2-unit scores ``s`` of query rows ``rows`` and keys ``cols`` (broadcast index
    tensors) after the softcap and the ALiBi bias, and ``t = tanh(s / c2)``, whose ``1 - t^2`` the backward
    multiplies into dS (``t`` is ``s`` itself without SOFTCAP, and unused)."""
    t = s
    if SOFTCAP:
        t = _tanh(s * (1.0 / softcap_log2))
        s = softcap_log2 * t
    if ALIBI:
        s = s - slope_log2 * tl.abs(rows + OFFSET - cols).to(tl.float32)
    return s, t


@triton.jit
def _attn_mask_tile(MASK_head, row0, col0, rows, cols, terms, N_q, N_k):
    """The user's mask over the tile at query row ``row0`` and key ``col0`` of one (b, h), at in-tile
    offsets ``rows`` and ``cols`` (broadcast index tensors), read at the row and column strides of ``terms``
    (:class:`~.records.ScoreTerms`): its raw values, 0 outside ``N_q x N_k``. The tile's base moves in 64-bit
    (``N_q x N_k`` may pass 2^31), the offsets inside it stay 32-bit."""
    stride_m, stride_n = terms.mask_stride_m, terms.mask_stride_n
    base = MASK_head + tl.cast(row0, tl.int64) * stride_m + tl.cast(col0, tl.int64) * stride_n
    in_tile = (row0 + rows < N_q) & (col0 + cols < N_k)
    return tl.load(base + rows * stride_m + cols * stride_n, mask=in_tile, other=0)
