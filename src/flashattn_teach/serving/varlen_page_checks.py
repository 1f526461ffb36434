"""Checks of :func:`flashattn_teach.flash_attention_varlen` over a paged KV cache (flash-attn's
``flash_attn_varlen_func(..., block_table=)``).

With ``block_table (B, max_blocks)``, ``k`` and ``v`` are page pools, not packed keys::

    k (num_blocks, H_kv, page_size, D)    v (num_blocks, H_kv, page_size, D_v)    q (total_q, H_q, D) as before

(this library's head-major layout; flash-attn's ``(num_blocks, page_size, H_kv, D)`` pool is passed as its
``.transpose(1, 2)`` view). Sequence ``b`` has ``n_b = cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` keys, at
positions ``[0, n_b)`` of its pages: key ``j`` at page ``block_table[b, j // page_size]``, slot ``j %
page_size`` (flash-attn's convention: with a block table, ``cu_seqlens_k`` still gives each sequence's key
count; the pages, not the packed axis, say where they are). Every check here runs before a key is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._validate.inputs import shape_str
from .._validate.varlen import check_cu_seqlens, check_head_groups, check_tensor
from ..errors import AttentionValueError
from .page_checks import check_block_table


@dataclass(frozen=True)
class PagedKeys:
    """Where the keys of a paged varlen call live: the table (int64, for indexing), each sequence's key
    count ``n_b`` and the pools' page size."""

    block_table: Tensor  # (B, max_blocks), int64, on q's device
    lengths: tuple[int, ...]  # (B,): n_b, read on the host from cu_seqlens_k
    page_size: int


def check_page_pools(q: object, k: object, v: object) -> None:
    """``q (total_q, H_q, D)``, ``k (num_blocks, H_kv, page_size, D)``, ``v (num_blocks, H_kv, page_size,
    D_v)`` on ``q``'s device, ``H_kv | H_q``, pages of at least one slot."""
    for name, t, want in (
        ("q", q, "(total_q, H_q, D)"),
        ("k", k, "(num_blocks, H_kv, page_size, D)"),
        ("v", v, "(num_blocks, H_kv, page_size, D_v)"),
    ):
        tensor = check_tensor(name, t, want)
        if tensor.dim() != len(want.split(",")):
            pools = " (with block_table, k and v are page pools)" if name != "q" else ""
            raise AttentionValueError(f"{name} must have shape {want}{pools}, got {shape_str(tensor)}")
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    shapes = f"q {shape_str(q)}, k {shape_str(k)}, v {shape_str(v)}"
    if k.shape[:3] != v.shape[:3]:
        raise AttentionValueError(
            f"the page pools k and v must share num_blocks, H_kv and page_size (dims 0-2), got {shapes}"
        )
    if q.shape[2] != k.shape[3]:
        raise AttentionValueError(f"q (dim 2) and k (dim 3) must have the same head dimension D, got {shapes}")
    check_head_groups(q.shape[1], k.shape[1], lambda: shapes)
    if k.shape[2] < 1:
        raise AttentionValueError(f"the pages must hold at least one slot (page_size = k.shape[2] >= 1), got {shapes}")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise AttentionValueError(f"{name} is on {t.device} but q is on {q.device}")


def check_paged_keys(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_k: object, block_table: object) -> PagedKeys:
    """Check a paged varlen call's pools, ``cu_seqlens_k`` and ``block_table``, and return where its keys
    lie. ``block_table`` is int32 (or int64) ``(B, max_blocks)`` with ``B = len(cu_seqlens_k) - 1``; each
    sequence fits its row (``n_b <= max_blocks * page_size``), and the ids of the pages it reads, ``block_table[b,
    p]`` for ``p < ceil(n_b / page_size)``, lie in ``[0, num_blocks)``; entries past them may hold anything.

    The ids are read on the host on every device: the call reads ``cu_seqlens_k`` there already, and an id
    out of range would be a device-side assert in the CUDA gather, not an error naming the entry."""
    check_page_pools(q, k, v)
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, None, "the number of keys read from the pages", q.device)
    B = cu_k.numel() - 1
    table = check_block_table(block_table, B, q.device)
    assert table is not None
    lengths = (cu_k[1:] - cu_k[:-1]).tolist()  # (B,): n_b, the keys of each sequence
    num_blocks, page_size = k.shape[0], k.shape[2]
    max_blocks = table.shape[1]
    for b, n in enumerate(lengths):
        if n > max_blocks * page_size:
            raise AttentionValueError(
                f"sequence {b} has {n} keys (cu_seqlens_k[{b + 1}] - cu_seqlens_k[{b}]) but its row of block_table "
                f"{shape_str(table)} holds at most max_blocks * page_size = {max_blocks} * {page_size} = "
                f"{max_blocks * page_size}; pass a block table with more columns"
            )
    ids = table.long()  # (B, max_blocks): index tensors are int64
    host = ids.cpu()
    used = torch.tensor([-(-n // page_size) for n in lengths], dtype=torch.int64)  # (B,): ceil(n_b / page_size)
    read = torch.arange(max_blocks)[None, :] < used[:, None]  # (B, max_blocks): the pages sequence b reads
    bad = (read & ((host < 0) | (host >= num_blocks))).nonzero().tolist()  # [[b, p], ...], vectorised
    if bad:
        b, p = bad[0]
        raise AttentionValueError(
            f"block_table[{b}, {p}] = {int(host[b, p])} is not a page of the pools: sequence {b} has {lengths[b]} "
            f"keys on pages [0, {int(used[b])}) of its row (page_size = k.shape[2] = {page_size}), and their ids "
            f"must lie in [0, num_blocks) = [0, {num_blocks}) (num_blocks = k.shape[0])"
        )
    return PagedKeys(block_table=ids, lengths=tuple(int(n) for n in lengths), page_size=page_size)
