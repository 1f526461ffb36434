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
