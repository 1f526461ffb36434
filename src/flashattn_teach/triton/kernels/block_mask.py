"""The block-mask classification kernel: one program per (b, h, query block i) evaluates the user's
translated ``mask_mod`` over each key block j of its row and writes the tile's kind (FlexAttention's block
mask, Dong et al. 2024, sec. 3.3; the CPU version is :mod:`flashattn_teach.flex.classify`).

    visible = MASK_MOD(b, h, q_idx, kv_idx, C0..C3) & (q_idx < N_q) & (kv_idx < N_k)   # (BLOCK_M, BLOCK_N)
    n = sum(visible):   n == BLOCK_M * BLOCK_N -> FULL,   n > 0 -> PARTIAL,   n == 0 -> SKIP

Rows and columns past ``N_q``, ``N_k`` count as invisible, as torch pads them, so a ragged tile is never
FULL. ``MASK_MOD`` is the ``@triton.jit`` function :func:`flashattn_teach.triton.usermod.compile_mask_mod`
emits (b, h int32 scalars; q_idx ``(BLOCK_M, 1)``, kv_idx ``(1, BLOCK_N)`` int32; C0..C3 pointers to the
tensors it captures), passed as a compile-time argument so each function compiles its own kernel.
"""

from __future__ import annotations

import triton
from triton import language as tl


@triton.jit
def block_kinds_kernel(
    KINDS,  # int8 (B|1, H|1, T_r, T_c), written
    stride_kb,
    stride_kh,
    stride_ki,
    stride_kj,
    N_q,
    N_k,
    T_c,
    C0,
    C1,
    C2,
    C3,
    MASK_MOD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KIND_SKIP: tl.constexpr,
    KIND_PARTIAL: tl.constexpr,
    KIND_FULL: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.program_id(2)
    q_idx = i * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]  # (BLOCK_M, 1)
    row = KINDS + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh + i.to(tl.int64) * stride_ki
    for j in range(0, T_c):
        kv_idx = j * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # (1, BLOCK_N)
        visible = MASK_MOD(b, h, q_idx, kv_idx, C0, C1, C2, C3) & (q_idx < N_q) & (kv_idx < N_k)
        n = tl.sum(tl.sum(visible.to(tl.int32), axis=1), axis=0)
        kind = tl.where(n == BLOCK_M * BLOCK_N, KIND_FULL, tl.where(n > 0, KIND_PARTIAL, KIND_SKIP))
        tl.store(row + j * stride_kj, kind.to(tl.int8))
