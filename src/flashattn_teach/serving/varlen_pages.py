"""The keys of :func:`flashattn_teach.flash_attention_varlen` read from a paged KV cache (flash-attn's
``flash_attn_varlen_func(..., block_table=)``, as vLLM's chunked prefill calls it).

Sequence ``b``'s ``n_b`` keys are positions ``[0, n_b)`` of its pages; position ``j`` lives at page
``block_table[b, j // page_size]``, slot ``j % page_size``. The call gathers them into the packed layout
the varlen path already runs, sequence after sequence, so that sequence ``b``'s keys land at
``cu_seqlens_k[b] : cu_seqlens_k[b + 1]``, exactly where ``cu_seqlens_k`` says::

    block_table = [[5, 2, ...],        page_size = 4, n = (6, 3)
                   [7, ...]]
    packed key    0 1 2 3 4 5 | 6 7 8
    (page, slot)  5,0 5,1 5,2 5,3 2,0 2,1 | 7,0 7,1 7,2

One indexed read of each pool, ``pool[page, :, slot]`` ``(total_k, H_kv, D)``: a copy of the keys the
sequences have and nothing else (no whole page past a sequence's end, no page of another sequence), the
same on every device. It is differentiable, so a pool that requires grad gets its gradient through it (the
slots no sequence reads get zero). The Triton prefill kernel therefore does not walk the pages itself (the
decode kernel, :func:`flashattn_teach.flash_attention_with_kvcache`, does): the copy costs
``total_k * H_kv * (D + D_v)`` elements read and written once, against the attention's
``sum_b len_q[b] * n_b * H_q * (D + D_v)`` multiply-adds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .varlen_page_checks import check_paged_keys


def gather_paged_keys(
    q: Tensor, k_pages: Tensor, v_pages: Tensor, cu_seqlens_k: Tensor, block_table: Tensor
) -> tuple[Tensor, Tensor]:
    """Packed ``(k (total_k, H_kv, D), v (total_k, H_kv, D_v))`` of the sequences ``cu_seqlens_k`` counts,
    read through ``block_table (B, max_blocks)`` from the pools ``k_pages (num_blocks, H_kv, page_size,
    D)``, ``v_pages (num_blocks, H_kv, page_size, D_v)`` (any strides: flash-attn's ``(num_blocks,
    page_size, H_kv, D)`` storage passed as ``.transpose(1, 2)`` reads the same). Checks everything first
    (:func:`flashattn_teach.serving.varlen_page_checks.check_paged_keys`)."""
    paged = check_paged_keys(q, k_pages, v_pages, cu_seqlens_k, block_table)
    device = q.device
    B = len(paged.lengths)
    n = torch.tensor(paged.lengths, dtype=torch.int64, device=device)  # (B,): n_b
    total_k = sum(paged.lengths)
    seq = torch.repeat_interleave(torch.arange(B, device=device), n, output_size=total_k)  # (total_k,): b of each key
    start = torch.cumsum(n, 0) - n  # (B,): cu_seqlens_k[b], where sequence b's keys begin on the packed axis
    j = torch.arange(total_k, device=device) - start[seq]  # (total_k,): each key's position in its sequence
    page = paged.block_table[seq, j // paged.page_size]  # (total_k,): the block id holding it
    slot = j % paged.page_size  # (total_k,)
    # pool[page, :, slot]: the two advanced indices, split by a slice, put their dim first:
    # (num_blocks, H_kv, page_size, D) -> (total_k, H_kv, D), flash-attn's packed layout
    return k_pages[page, :, slot], v_pages[page, :, slot]
