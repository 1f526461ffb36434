"""Tile loads and stores shared by the forward and backward kernels.

A tile is ``BLOCK`` consecutive sequence rows of one (batch, head) by the padded head dimension
``BLOCK_D``. The caller passes a pointer to the block's first row, already advanced in 64-bit arithmetic
(``N x stride_n`` may pass 2^31 elements), so the offsets within a tile stay 32-bit. Rows past the
sequence (a ragged last block) and lanes past the head dimension ``D`` read 0, adding nothing to a dot
product; ``ROWS_OK`` drops the row mask where every row is known to exist (the unmasked stages).

A head dim that is the sum of two powers of two (192 = 128 + 64, DeepSeek's MLA prefill) is read as two
lane groups rather than padded to the next power of two (256, a quarter of every product wasted):
``BLOCK_D`` lanes by :func:`_load_block` (``D > BLOCK_D``: all of them real), then the ``BLOCK_D2`` lanes
``[BLOCK_D, BLOCK_D + BLOCK_D2)`` by :func:`_load_block_hi`. A product over the head dim is then two MMAs
into one accumulator, ``S = Q[:, :BLOCK_D] K[:, :BLOCK_D]^T + Q[:, BLOCK_D:] K[:, BLOCK_D:]^T``, and a
gradient over it two accumulators. ``BLOCK_D2 = 0`` (constexpr) compiles none of it.

On Hopper a tile can instead arrive by TMA (:func:`_load_tile_tma`) from a tensor descriptor of the whole
``(B, H, N, X)`` tensor: the copy engine computes the addresses and fills rows past ``N`` and lanes past
``X`` with zeros, so the loop issues one instruction per tile and holds no address registers.
"""

from __future__ import annotations

import triton
from triton import language as tl


@triton.jit
def _load_block(
    ptr, offs_r, offs_d, stride_r, stride_d, in_r, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS_OK: tl.constexpr
):
    """The ``(len(offs_r), BLOCK_D)`` tile at ``ptr`` (a block's first row): rows ``offs_r`` (from 0),
    head-dim lanes ``offs_d``. Rows outside ``in_r`` and padded lanes ``>= D`` read 0, so they add nothing
    to a dot product. ``ROWS_OK`` (constexpr): every row exists, so no mask is built unless D is padded.
    ``D > BLOCK_D``: the tile is the first lane group of a split head dim (:func:`_load_block_hi` reads the
    rest), every lane of it real."""
    ptrs = ptr + offs_r[:, None] * stride_r + offs_d[None, :] * stride_d
    if ROWS_OK:
        if D >= BLOCK_D:
            return tl.load(ptrs)
        return tl.load(ptrs, mask=offs_d[None, :] < D, other=0.0)
    return tl.load(ptrs, mask=in_r[:, None] & (offs_d[None, :] < D), other=0.0)


@triton.jit
def _load_block_T(
    ptr, offs_r, offs_d, stride_r, stride_d, in_r, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS_OK: tl.constexpr
):
    """The transpose of :func:`_load_block`'s tile, ``(BLOCK_D, len(offs_r))``, read in that layout rather
    than transposed on chip; same arguments, same zeros."""
    ptrs = ptr + offs_r[None, :] * stride_r + offs_d[:, None] * stride_d
    if ROWS_OK:
        if D >= BLOCK_D:
            return tl.load(ptrs)
        return tl.load(ptrs, mask=offs_d[:, None] < D, other=0.0)
    return tl.load(ptrs, mask=in_r[None, :] & (offs_d[:, None] < D), other=0.0)


@triton.jit
def _load_block_hi(
    ptr,
    offs_r,
    stride_r,
    stride_d,
    in_r,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    ROWS_OK: tl.constexpr,
    TRANS: tl.constexpr = False,
):
    """The second lane group of a split head dim: lanes ``[BLOCK_D, BLOCK_D + BLOCK_D2)`` of the tile at
    ``ptr``, ``(len(offs_r), BLOCK_D2)`` (``TRANS``: ``(BLOCK_D2, len(offs_r))``). It is a tile of head dim
    ``D - BLOCK_D`` whose first lane sits ``BLOCK_D`` lanes in, so lanes past ``D`` read 0 as in
    :func:`_load_block`, and none is masked when ``D = BLOCK_D + BLOCK_D2``."""
    lanes = tl.arange(0, BLOCK_D2)
    hi = ptr + BLOCK_D * stride_d
    # one return: triton checks every return's type against the others, also in a branch not compiled
    if TRANS:
        tile = _load_block_T(hi, offs_r, lanes, stride_r, stride_d, in_r, D - BLOCK_D, BLOCK_D2, ROWS_OK)
    else:
        tile = _load_block(hi, offs_r, lanes, stride_r, stride_d, in_r, D - BLOCK_D, BLOCK_D2, ROWS_OK)
    return tile


@triton.jit
def _load_tile_tma(desc, b, h, start, BLOCK: tl.constexpr, BLOCK_X: tl.constexpr):
    """Rows ``[start, start + BLOCK)`` of head ``(b, h)`` through the descriptor ``desc``, whose box is
    ``(1, 1, BLOCK, BLOCK_X)``: ``(BLOCK, BLOCK_X)``, zeros past the tensor's ends."""
    return desc.load([b, h, start, 0]).reshape(BLOCK, BLOCK_X)


@triton.jit
def _store_block(ptr, tile, offs_r, offs_d, stride_r, stride_d, in_r, D):
    """Write the entries of a :func:`_load_block`-shaped ``tile`` that lie in rows ``in_r`` and lanes ``< D``."""
    tl.store(
        ptr + offs_r[:, None] * stride_r + offs_d[None, :] * stride_d, tile, mask=in_r[:, None] & (offs_d[None, :] < D)
    )


@triton.jit
def _store_block_hi(ptr, tile, offs_r, stride_r, stride_d, in_r, D, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr):
    """Write a :func:`_load_block_hi`-shaped ``tile`` (lanes ``[BLOCK_D, BLOCK_D + BLOCK_D2)``) where its rows
    lie in ``in_r`` and its lanes below ``D``."""
    _store_block(ptr + BLOCK_D * stride_d, tile, offs_r, tl.arange(0, BLOCK_D2), stride_r, stride_d, in_r, D - BLOCK_D)
