"""The dropout keep mask of one score tile, inside a kernel: the draw of :mod:`flashattn_teach.dropout`.

``tl.randint(seed, counter)`` is Philox4x32-10 on the counter words ``(low, high, 0, 0)`` of a 64-bit
counter with the key words ``(seed low, seed high)``, the arithmetic the CPU references run in torch, so
for the same ``DropoutKey`` the kernels and the references keep the same weights (a test compares them bit
for bit). The mask is drawn again wherever it is needed (forward, dK/dV, dQ), never stored.
"""

from __future__ import annotations

import triton
from triton import language as tl


@triton.jit
def _dropout_keep(seed, offset, bh, offs_m, offs_n, N_q, N_k, threshold):
    """Bool ``(len(offs_m), len(offs_n))``: whether weight ``P[b, h, i, j]`` survives, for ``bh = b * H_q + h``,
    rows ``i = offs_m`` and columns ``j = offs_n`` of the whole score matrix; ``threshold = round(p 2^31)``."""
    # counter = offset + ((b * H_q + h) * N_q + i) * N_k + j, in 64 bits: B * H * N_q * N_k passes 2^32
    row_base = (bh.to(tl.int64) * N_q + offs_m.to(tl.int64)) * N_k  # (BLOCK_M,)
    counter = offset + row_base[:, None] + offs_n.to(tl.int64)[None, :]  # (BLOCK_M, BLOCK_N)
    r = tl.randint(seed, counter)  # uint32, Philox4x32-10 word 0
    # keep iff the top 31 bits reach the threshold: P(keep) = 1 - threshold / 2^31
    return (r >> 1).to(tl.int32) >= threshold


@triton.jit
def _packed_dropout(CU_SEQLENS_Q, CU_SEQLENS_K, n_seq, q_start, k_start, dropout_offset):
    """``(offset, N_q, N_k)`` of the counters of packed sequences (``VARLEN``), for a program of the sequence
    starting at rows ``q_start, k_start``: the counter is that of the packed ``total_q x total_k`` matrix of
    one batch element (``flashattn_teach.api.varlen``), ``offset + (h * total_q + q_start + i') * total_k +
    k_start + j'`` for head h and in-sequence row i', column j'. The start rows go into the offset, so
    ``_dropout_keep(seed, offset, h, i', j', total_q, total_k, threshold)`` draws it."""
    total_q = tl.load(CU_SEQLENS_Q + n_seq)  # cu_seqlens (B + 1,): the last bound is the packed length
    total_k = tl.load(CU_SEQLENS_K + n_seq)
    return dropout_offset + q_start * total_k + k_start, total_q, total_k
