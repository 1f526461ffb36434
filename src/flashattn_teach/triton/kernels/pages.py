"""Paged key/value caches (flash-attn's ``block_table``) in the decode kernel (:mod:`.decode`): where key
``j`` of a batch element lives.

Key ``j`` lives in page ``block_table[b, j // PAGE_SIZE]`` at slot ``j % PAGE_SIZE`` of ``K (num_blocks,
H_kv, PAGE_SIZE, D)``, so each key of a ``BLOCK_N``-key block gets its own row address from the pages'
strides: any page size, and flash-attn's ``(num_blocks, PAGE_SIZE, H_kv, D)`` storage as a transposed
view. Pages of at least ``BLOCK_N`` keys hold a block in two pages at most, so two block ids serve a block
(``WIDE``). Block ids are clamped to ``[0, num_blocks)``: a CUDA table is never read on the host, and no
id reads outside the cache.
"""

from __future__ import annotations

import triton
from triton import language as tl


@triton.jit
def _block_ids(table, start, split_end, stride_bt_n, PAGE_SIZE, num_blocks, BLOCK_N: tl.constexpr, WIDE: tl.constexpr):
    """The pages of key block ``[start, start + BLOCK_N)``: ids from ``table`` (the batch element's row of
    the block table) clamped into ``[0, num_blocks)``, so that no id reads outside the cache; entries of
    keys at or past ``split_end`` are not read (they may lie past the sequence's pages).

    ``WIDE`` (``PAGE_SIZE >= BLOCK_N``): the block lies in page ``start // PAGE_SIZE`` and perhaps the
    next, so two scalar ids serve it (read by one two-entry load); otherwise ``(BLOCK_N,)`` ids, one per
    key (returned twice, so that both variants carry the same pair through the loop)."""
    if WIDE:
        first = start // PAGE_SIZE + tl.arange(0, 2)  # (2,): this page and the next
        ids = tl.load(table + first * stride_bt_n, mask=first * PAGE_SIZE < split_end, other=0)
        ids = tl.minimum(tl.maximum(ids, 0), num_blocks - 1)
        page0 = tl.sum(tl.where(tl.arange(0, 2) == 0, ids, 0), 0)
        page1 = tl.sum(tl.where(tl.arange(0, 2) == 1, ids, 0), 0)
    else:
        cols = start + tl.arange(0, BLOCK_N)
        page0 = tl.load(table + (cols // PAGE_SIZE) * stride_bt_n, mask=cols < split_end, other=0)
        page0 = tl.minimum(tl.maximum(page0, 0), num_blocks - 1)
        page1 = page0
    return page0, page1


@triton.jit
def _page_slots(page0, page1, start, cols, PAGE_SIZE, WIDE: tl.constexpr):
    """``(page, slot)`` of each key ``cols = start + [0, BLOCK_N)`` from :func:`_block_ids`'s ids: the page
    as int64 (``page x page stride`` may pass 2^31) and the slot ``cols % PAGE_SIZE``."""
    if WIDE:
        t = cols - (start // PAGE_SIZE) * PAGE_SIZE  # the slot in the first page, or PAGE_SIZE more in the next
        next_page = t >= PAGE_SIZE
        page = tl.where(next_page, page1, page0).to(tl.int64)
        slot = tl.where(next_page, t - PAGE_SIZE, t)
    else:
        page = page0.to(tl.int64)
        slot = cols % PAGE_SIZE
    return page, slot
