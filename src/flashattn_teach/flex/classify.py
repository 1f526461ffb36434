"""Which (query block, key block) tiles a ``mask_mod`` leaves empty, full or in between, found tile by tile
on the CPU (or any device torch runs on) without ever holding the ``N_q x N_k`` mask.

FlexAttention's block mask (Dong et al. 2024, "Flex Attention: A Programming Model for Generating Optimized
Attention Kernels", sec. 3.3) sorts every ``BLOCK_M x BLOCK_N`` tile of a mask into three kinds: no
element visible (skipped), every element visible (run without ``mask_mod``), and the rest (run with it).
torch's ``create_block_mask`` evaluates ``mask_mod`` over the whole ``B x H x N_q x N_k`` grid first and
sums it block by block. Here the grid is cut into chunks of whole tiles, and ``mask_mod`` is called on each
as torch calls it, per element through nested vmaps (:mod:`.per_element`), over the chunk's index vectors:

    b       (bs,)     int64, batch elements b0 .. b0 + bs - 1
    h       (hs,)     int64, heads h0 .. h0 + hs - 1
    q_idx   (R,)      int64, the chunk's query rows (absolute positions)
    kv_idx  (C,)      int64, the chunk's key columns
    mask_mod(b, h, q_idx, kv_idx) -> bool, each argument 0-d inside the call; (bs, hs, R, C) out

and reduced to the chunk's tiles, so the peak memory is one chunk (:data:`CHUNK_ELEMENTS`) per worker plus
the two ``O(B H T_r T_c)`` tile tables. On the CPU the chunks run on the ``parallel`` path's worker threads,
each with single-threaded torch ops (:mod:`flashattn_teach.reference.workers`), which keeps a busy core from
stalling every op; a small call, or another device, runs them in the calling thread.

A ``mask_mod`` that never reads ``b`` (or ``h``) comes out of vmap expanded along it, and then one
classification serves every batch element (head). :func:`result_dims` finds that out from a single element
per (b, h) before the chunks run; the tables then keep a size-1 dim there.

Padding follows torch: rows ``>= N_q`` and columns ``>= N_k`` of a ragged last block count as invisible,
so a ragged block is never "every element visible" (it is run with ``mask_mod``, which also bounds it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .mods import KIND_FULL, KIND_PARTIAL, KIND_SKIP
from .per_element import visible

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
# Runs a task on every chunk's arguments (the CPU worker pool of flashattn_teach.reference.workers, which
# the callers above this layer pass in): ``pool(task, chunks)``.
Pool = Callable[[Callable[..., None], Sequence[tuple[int, ...]]], None]

# Elements of mask_mod's result evaluated at once: 2**20 bools (1 MiB), a few MiB with the int64
# intermediates a typical mask_mod makes (q_idx - kv_idx), and few enough Python calls at N = 16384.
CHUNK_ELEMENTS = 1 << 20
# Below this many elements in all, the chunks run in the calling thread (a pool's start-up costs more).
MIN_PARALLEL_ELEMENTS = 1 << 22


def evaluate(mask_mod: MaskMod, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """``mask_mod`` at every element of the index vectors ``b (bs,)``, ``h (hs,)``, ``q_idx (R,)``,
    ``kv_idx (C,)``, called per element: bool ``(bs, hs, R, C)``."""
    return visible(mask_mod, b, h, q_idx, kv_idx).expand(len(b), len(h), len(q_idx), len(kv_idx))


def result_dims(mask_mod: MaskMod, B: int, H: int, device: torch.device) -> tuple[int, int]:
    """``(B or 1, H or 1)``: the sizes of ``mask_mod``'s result along b and h, from one (q_idx, kv_idx) = (0, 0)
    element per (b, h). A size of 1 means the function does not read that argument: vmap expands a result that
    does not depend on a mapped argument, and :func:`.per_element.compact` keeps size 1 there. (Without
    Python control flow, which vmap refuses, what a result depends on is the same at every element.)"""
    b, h = torch.arange(B, device=device), torch.arange(H, device=device)
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    out = visible(mask_mod, b, h, zero, zero)  # (B|1, H|1, 1, 1)
    return out.shape[0], out.shape[1]


def tile_visibility(
    mask_mod: MaskMod,
    B: int,
    H: int,
    N_q: int,
    N_k: int,
    block_m: int,
    block_n: int,
    device: torch.device,
    *,
    chunk_elements: int = CHUNK_ELEMENTS,
    pool: Pool | None = None,
) -> tuple[Tensor, Tensor]:
    """``(some, every)``, bool ``(B|1, H|1, T_r, T_c)``: whether some element of tile (i, j) is visible, and
    whether every one of its ``block_m x block_n`` is (padding past ``N_q``, ``N_k`` is not). Evaluates
    ``mask_mod`` over chunks of at most ``max(chunk_elements, block_m * block_n)`` elements."""
    B_o, H_o = result_dims(mask_mod, B, H, device)
    T_r, T_c = -(-N_q // block_m), -(-N_k // block_n)
    some = torch.zeros(B_o, H_o, T_r, T_c, dtype=torch.bool, device=device)
    every = torch.zeros_like(some)
    # a chunk: bs batch elements x hs heads x tr query blocks x tc key blocks, filled key blocks first
    tiles = max(1, chunk_elements // (block_m * block_n))
    tc = min(T_c, tiles)
    tr = min(T_r, max(1, tiles // tc))
    hs = min(H_o, max(1, tiles // (tc * tr)))
    bs = min(B_o, max(1, tiles // (tc * tr * hs)))
    rows = torch.arange(N_q, device=device)
    cols = torch.arange(N_k, device=device)

    def classify_chunk(b0: int, b1: int, h0: int, h1: int, i0: int, i1: int, j0: int, j1: int) -> None:
        b = torch.arange(b0, b1, device=device)
        h = torch.arange(h0, h1, device=device)
        q_idx, kv_idx = rows[i0 * block_m : i1 * block_m], cols[j0 * block_n : j1 * block_n]
        visible = evaluate(mask_mod, b, h, q_idx, kv_idx)  # (bs, hs, R, C)
        # a ragged last block: pad with invisible elements, as torch does
        pad_r, pad_c = (i1 - i0) * block_m - q_idx.shape[0], (j1 - j0) * block_n - kv_idx.shape[0]
        if pad_r or pad_c:
            visible = F.pad(visible, (0, pad_c, 0, pad_r))
        # (bs, hs, R, C) -> (bs, hs, i1 - i0, block_m, j1 - j0, block_n)
        t = visible.reshape(b1 - b0, h1 - h0, i1 - i0, block_m, j1 - j0, block_n)
        some[b0:b1, h0:h1, i0:i1, j0:j1] = t.any(dim=5).any(dim=3)
        every[b0:b1, h0:h1, i0:i1, j0:j1] = t.all(dim=5).all(dim=3)

    chunks = [
        (b0, min(b0 + bs, B_o), h0, min(h0 + hs, H_o), i0, min(i0 + tr, T_r), j0, min(j0 + tc, T_c))
        for b0 in range(0, B_o, bs)
        for h0 in range(0, H_o, hs)
        for i0 in range(0, T_r, tr)
        for j0 in range(0, T_c, tc)
    ]
    # CPU chunks go to the worker threads with single-threaded ops (``pool``, the parallel path's), as its
    # tiles do: one multi-threaded op per chunk stalls at its barrier whenever another process holds a core
    if pool is None or device.type != "cpu" or B_o * H_o * N_q * N_k < MIN_PARALLEL_ELEMENTS:
        for chunk in chunks:
            classify_chunk(*chunk)
    else:
        pool(classify_chunk, chunks)
    return some, every


def retile(
    kinds: Tensor, seq_lengths: tuple[int, int], BLOCK_SIZE: tuple[int, int], block_m: int, block_n: int
) -> Tensor:
    """int8 kinds ``(B|1, H|1, T_r, T_c)`` of ``BLOCK_SIZE`` blocks -> the kinds of ``block_m x block_n``
    tiles, conservative (SKIP iff every block a tile overlaps is SKIP, FULL iff every one is FULL), by 2-D
    prefix sums: O(blocks + tiles)."""
    if (block_m, block_n) == BLOCK_SIZE:
        return kinds
    (N_q, N_k), (size_m, size_n), device = seq_lengths, BLOCK_SIZE, kinds.device

    def overlapped(N: int, block: int, size: int) -> tuple[Tensor, Tensor]:
        """Per tile, the first and one past the last block of ``size`` that it overlaps."""
        start = torch.arange(0, N, block, device=device)
        end = torch.clamp(start + block, max=N)
        return start // size, (end - 1) // size + 1

    r_lo, r_hi = overlapped(N_q, block_m, size_m)  # (T_r',)
    c_lo, c_hi = overlapped(N_k, block_n, size_n)  # (T_c',)
    area = (r_hi - r_lo)[:, None] * (c_hi - c_lo)[None, :]  # (T_r', T_c') blocks under each tile

    def blocks_in_tiles(table: Tensor) -> Tensor:
        """Per tile, the sum of ``table`` (B|1, H|1, T_r, T_c) over the blocks it overlaps."""
        # P[r, c] = sum of table[:r, :c], the 2-D prefix sum
        P = torch.nn.functional.pad(table.to(torch.int32).cumsum(2).cumsum(3), (1, 0, 1, 0))

        def at(r: Tensor, c: Tensor) -> Tensor:
            return P[:, :, r[:, None], c[None, :]]  # (B|1, H|1, T_r', T_c')

        return at(r_hi, c_hi) - at(r_lo, c_hi) - at(r_hi, c_lo) + at(r_lo, c_lo)

    visible = blocks_in_tiles(kinds != KIND_SKIP)
    full = blocks_in_tiles(kinds == KIND_FULL)
    out = torch.full(visible.shape, KIND_PARTIAL, dtype=torch.int8, device=device)
    out[visible == 0] = KIND_SKIP
    out[full == area] = KIND_FULL
    return out
