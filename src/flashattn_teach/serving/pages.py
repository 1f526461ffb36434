"""Where a decode step's keys live: contiguous caches, or pages of a pool through a block table (vLLM's
PagedAttention, Kwon et al. 2023; flash-attn's ``block_table``), and the in-place append through it.

A paged pool ``k_cache (num_blocks, H_kv, page_size, D)`` holds key position ``j`` of batch element ``b``
at page ``block_table[b, j // page_size]``, slot ``j % page_size``. A key range ``[s0, s1)`` needs the
pages ``p0 = s0 // page_size`` to ``p1 = ceil(s1 / page_size)`` of its row, and only those are read::

    block_table[b] = [5, 2, 7, ...]            page_size = 4, range [3, 10)
    positions        0 1 2 3 | 4 5 6 7 | 8 9 10 11
    page             5       | 2       | 7
    read                   x | x x x x | x x          pages (5, 2, 7): k_cache[[5, 2, 7]] per head
                                                       -> (H_kv, 3 * 4, D), sliced to [3 - 0, 10 - 0)

A run of consecutive page ids (``7, 8, 9``) whose pages follow each other in memory with no gap between a
page's last slot and the next page's first (flash-attn's ``(num_blocks, page_size, H_kv, D)`` layout, or
one key/value head) is read as a strided view, without a copy; any other run is gathered into a new
``(H_kv, n_pages * page_size, D)`` tensor, one copy of the range's keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def _adjacent(pool: Tensor, n: int) -> bool:
    """Whether ``n`` consecutive pages of ``pool (num_blocks, H_kv, page_size, D)`` lie back to back for each
    head: one page, one slot per page, or the next page starting where the last slot's stride puts it (as
    in flash-attn's ``(num_blocks, page_size, H_kv, D)`` layout, or with one key/value head)."""
    page_size = pool.shape[2]
    return n == 1 or page_size == 1 or pool.stride(0) == page_size * pool.stride(2)


def _pages_view(pool: Tensor, first: int, n: int, ids: Tensor) -> Tensor:
    """``(H_kv, n * page_size, D)``: pages ``ids`` (``n`` of them; ``first`` their first id when they are
    consecutive, else -1) of ``pool (num_blocks, H_kv, page_size, D)``, in key order."""
    _, H_kv, page_size, D = pool.shape
    if first >= 0 and _adjacent(pool, n):  # a strided view of the pool, no copy
        # (n, H_kv, page_size, D) -> (H_kv, n, page_size, D) -> (H_kv, n * page_size, D)
        return pool[first : first + n].transpose(0, 1).reshape(H_kv, n * page_size, D)
    if pool.requires_grad and torch.is_grad_enabled():  # out= is not differentiated: one indexed gather
        # (H_kv, num_blocks, page_size, D)[:, ids] -> (H_kv, n, page_size, D) -> (H_kv, n * page_size, D)
        return pool.transpose(0, 1)[:, ids].reshape(H_kv, n * page_size, D)
    # one copy, head by head: pool[:, h] (num_blocks, page_size, D) -> its pages ids, (n, page_size, D), each
    # page a contiguous run of page_size * D elements (a gather of whole pages, about a memcpy's speed)
    out = pool.new_empty(H_kv, n, page_size, D)
    for h in range(H_kv):
        torch.index_select(pool[:, h], 0, ids, out=out[h])
    return out.reshape(H_kv, n * page_size, D)  # a view of out


@dataclass(frozen=True)
class ElementCache:
    """The keys and values of one batch element: rows of contiguous caches ``(1, H_kv, N_max, D)``, or a
    paged pool with the element's row of the block table (``ids``; ``pages`` the same on the host)."""

    k_cache: Tensor
    v_cache: Tensor
    ids: Tensor | None = None  # (max_blocks,) on the caches' device; None: contiguous
    pages: tuple[int, ...] = ()

    @property
    def H_kv(self) -> int:
        return self.k_cache.shape[1]

    @property
    def D_v(self) -> int:
        return self.v_cache.shape[3]

    def page_span(self, s0: int, s1: int) -> tuple[int, int]:
        """``[p0, p1)``, the positions in the block table row of the pages keys ``[s0, s1)`` lie on."""
        page_size = self.k_cache.shape[2]
        return s0 // page_size, -(-s1 // page_size)

    def _consecutive(self, p0: int, p1: int) -> bool:
        run = self.pages[p0:p1]
        return all(b == run[0] + i for i, b in enumerate(run))

    def reads_a_view(self, s0: int, s1: int) -> bool:
        """Whether keys ``[s0, s1)`` are read without a copy: contiguous caches, or consecutive page ids
        whose pages lie back to back for each head in both pools (:func:`_adjacent`)."""
        if self.ids is None:
            return True
        p0, p1 = self.page_span(s0, s1)
        pools = (self.k_cache, self.v_cache)
        return self._consecutive(p0, p1) and all(_adjacent(pool, p1 - p0) for pool in pools)

    def read(self, s0: int, s1: int) -> tuple[Tensor, Tensor]:
        """``(k (1, H_kv, s1 - s0, D), v (1, H_kv, s1 - s0, D_v))``: the keys ``[s0, s1)``, from the pages
        of that range alone when paged (the module docs' picture)."""
        if self.ids is None:
            if s0 == 0 and s1 == self.k_cache.shape[2]:  # the whole cache: no view to make
                return self.k_cache, self.v_cache
            return self.k_cache.narrow(2, s0, s1 - s0), self.v_cache.narrow(2, s0, s1 - s0)
        p0, p1 = self.page_span(s0, s1)
        first = self.pages[p0] if self._consecutive(p0, p1) else -1
        start = s0 - p0 * self.k_cache.shape[2]  # the range's first key within its first page
        k, v = (_pages_view(pool, first, p1 - p0, self.ids[p0:p1]) for pool in (self.k_cache, self.v_cache))
        return k[None, :, start : start + s1 - s0], v[None, :, start : start + s1 - s0]


def element_caches(k_cache: Tensor, v_cache: Tensor, block_table: Tensor | None) -> list[ElementCache]:
    """One :class:`ElementCache` per batch element: ``B`` of them (``block_table (B, max_blocks)``, or
    contiguous caches ``(B, H_kv, N_max, D)``). A paged table is read on the host once for the whole call
    (its ids choose the views; the CPU paths read the lengths on the host too)."""
    if block_table is None:
        B = k_cache.shape[0]
        if B == 1:
            return [ElementCache(k_cache, v_cache)]
        return [ElementCache(k_cache[b : b + 1], v_cache[b : b + 1]) for b in range(B)]
    ids = block_table.long()  # (B, max_blocks): index tensors are int64
    rows = ids.tolist()
    return [ElementCache(k_cache, v_cache, ids=ids[b], pages=tuple(rows[b])) for b in range(block_table.shape[0])]


def append_to_pages(
    k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, block_table: Tensor, cache_seqlens: list[int]
) -> None:
    """Write ``k (B, H_kv, N_new_kv, D), v`` in place at positions ``[cache_seqlens[b], cache_seqlens[b] +
    N_new_kv)`` of each batch element, through the block table: position ``j`` goes to page
    ``block_table[b, j // page_size]``, slot ``j % page_size``. Only those slots change."""
    page_size = k_cache.shape[2]
    N_new_kv = k.shape[2]
    device = k_cache.device
    first = torch.tensor(cache_seqlens, dtype=torch.int64, device=device)  # (B,)
    pos = first[:, None] + torch.arange(N_new_kv, device=device)  # (B, N_new_kv): global key positions
    page = block_table.long().gather(1, pos // page_size)  # (B, N_new_kv): block id of each position
    slot = pos % page_size  # (B, N_new_kv)
    with torch.no_grad():  # an in-place write of inference state (check_no_grad_through_write)
        # pool[page, :, slot]: (B, N_new_kv, H_kv, D), the advanced dims first; k as (B, N_new_kv, H_kv, D)
        k_cache[page, :, slot] = k.transpose(1, 2)
        v_cache[page, :, slot] = v.transpose(1, 2)
