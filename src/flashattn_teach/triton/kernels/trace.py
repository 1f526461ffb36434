"""The forward's trace build (issue 39): what :func:`.forward_inner._attn_fwd_inner` computed, key block by key block.

With ``TRACE`` (a ``tl.constexpr``, False by default: the kernel then compiles as without it, ``trace`` being a
None argument, which the JIT makes a constant) the programs of one head ``(b, h)`` store, after folding in key
block ``j``, their rows' state float32, one record per (query block ``i``, key block ``j``, row) as
``core/kernel.py``'s ``_trace_tile`` lays it out, so that one reader (``replay/kernel_trace.py``) reads both:

    trace.buffer[i, j, row, :] = [ s (BLOCK_N) | m_i | l_i | alpha | acc (BLOCK_DV) ]

``s = S_ij log2(e)`` (the scores after the scale and every modifier, masked ones ``-inf``, in base 2), ``m_i`` in
base 2, ``l_i``, ``alpha = exp2(m_old - m_new)`` and ``acc`` unnormalised (after dropout, where it drops). The
buffer and its strides come as :class:`flashattn_teach.triton.forward_trace.ForwardTrace`.
"""

from __future__ import annotations

import triton
from triton import language as tl


@triton.jit
def _trace_block(trace, s2, m_i, l_i, alpha, acc, b, h, start_m, start_n, BLOCK_N: tl.constexpr):
    """Record ``(i, j) = (start_m / BLOCK_M, start_n / BLOCK_N)`` of head ``(b, h)``, if it is the traced one:
    ``s2 (BLOCK_M, BLOCK_N)``, ``m_i, l_i, alpha (BLOCK_M,)``, ``acc (BLOCK_M, BLOCK_DV)``."""
    BLOCK_M: tl.constexpr = s2.shape[0]
    BLOCK_DV: tl.constexpr = acc.shape[1]
    W: tl.constexpr = BLOCK_N + 3 + BLOCK_DV  # one record row
    if (b == trace.b) & (h == trace.h):
        block = trace.buffer + (start_m // BLOCK_M) * trace.stride_i + (start_n // BLOCK_N) * trace.stride_j
        rec = block + tl.arange(0, BLOCK_M) * W  # (BLOCK_M,): each row's record
        tl.store(rec[:, None] + tl.arange(0, BLOCK_N)[None, :], s2)  # (BLOCK_M, BLOCK_N)
        tl.store(rec + BLOCK_N, m_i)
        tl.store(rec + BLOCK_N + 1, l_i)
        tl.store(rec + BLOCK_N + 2, alpha)
        tl.store(rec[:, None] + BLOCK_N + 3 + tl.arange(0, BLOCK_DV)[None, :], acc)  # (BLOCK_M, BLOCK_DV)
