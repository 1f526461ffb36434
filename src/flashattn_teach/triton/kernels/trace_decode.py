"""The decode kernel's trace build (issue 39): what :func:`.decode.decode_split_fwd` stores with ``TRACE=True``.

For one query head ``(b, h)`` (:class:`DecodeTraceRecord`), every split's program stores, after each key
block it folds in, its rows' state, float32, one record per (split ``s``, key block ``j`` of the split, query
``n``)::

    Trace[s, j, n, :] = [ s2 (BLOCK_N) | m_i | l_i | alpha | acc (BLOCK_DV) ]

with ``s2 = scale log2(e) q.k`` (softcap and ALiBi applied, ``-inf`` where masked), ``m_i`` in base 2 and ``acc``
unnormalised: the state after FA2 Alg. 1 lines 8-10 in the kernel's own units. ``j`` counts blocks from the
split's first key (``(start - split_begin) / BLOCK_N``); blocks a program skips leave their records as they
were. The splits' partials ``(O_s, lse_s)`` are not traced: the kernel writes them to its partials buffer
anyway (:class:`~.records.Partials`), which the trace's reader keeps.

With ``TRACE=False`` (the default) ``Trace`` is None, a constant, and none of this is compiled: the kernel's SASS
is the one before the trace build (``tests/triton/test_triton_trace_decode_sass.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import triton
from torch import Tensor
from triton import language as tl


class DecodeTraceRecord(NamedTuple):
    """The trace buffer ``ptr (num_splits, blocks, N_new, BLOCK_N + 3 + BLOCK_DV)`` float32 of query head
    ``head`` of batch element ``batch``; ``blocks`` key blocks a split may hold at most."""

    ptr: Tensor
    batch: int
    head: int
    blocks: int


def trace_width(block_n: int, block_dv: int) -> int:
    """One record's length: ``BLOCK_N`` scores, ``m_i``, ``l_i``, ``alpha``, ``BLOCK_DV`` lanes of ``acc``."""
    return block_n + 3 + block_dv


@triton.jit
def _trace_rows(Trace, b, h, n, in_rows, s, split_begin, N_new, W: tl.constexpr):
    """``(rows, ok, split_begin, block_stride)``: each row's record of the split's block 0 ``(BLOCK_M,)``, and
    which rows are the traced head's; what :func:`_trace_block` takes."""
    ok = in_rows & (h == Trace.head) & (n * 0 + b == Trace.batch)  # b as a (BLOCK_M,) vector, as the rows
    rows = Trace.ptr + ((s * Trace.blocks).to(tl.int64) * N_new + n) * W
    return rows, ok, split_begin, N_new * W


@triton.jit
def _trace_block(trace, s, m_i, l_i, alpha, acc, start, BLOCK_N: tl.constexpr):
    """Store the state after key block ``[start, start + BLOCK_N)``: ``s (BLOCK_M, BLOCK_N)``, ``m_i, l_i,
    alpha (BLOCK_M,)``, ``acc (BLOCK_M, BLOCK_DV)``, at the rows of ``trace`` (:func:`_trace_rows`)."""
    rows, ok, split_begin, block_stride = trace
    BLOCK_DV: tl.constexpr = acc.shape[1]
    rec = rows + ((start - split_begin) // BLOCK_N) * block_stride  # (BLOCK_M,) pointers
    tl.store(rec[:, None] + tl.arange(0, BLOCK_N)[None, :], s, mask=ok[:, None])  # (BLOCK_M, BLOCK_N)
    tl.store(rec + BLOCK_N, m_i, mask=ok)
    tl.store(rec + BLOCK_N + 1, l_i, mask=ok)
    tl.store(rec + BLOCK_N + 2, alpha, mask=ok)
    tl.store(rec[:, None] + BLOCK_N + 3 + tl.arange(0, BLOCK_DV)[None, :], acc, mask=ok[:, None])
