"""Checks of a paged KV cache (flash-attn's ``block_table``) and of ``cache_leftpad`` in a decode step.

A paged cache keeps every sequence's keys in fixed-size pages of one pool, ``k_cache (num_blocks, H_kv,
page_size, D)`` (this library's head-major layout; flash-attn's ``(num_blocks, page_size, H_kv, D)`` pool
is passed as its ``.transpose(1, 2)`` view), and ``block_table (B, max_blocks)`` says which page holds
which stretch of batch element ``b``'s keys: key position ``j`` lives at page ``block_table[b, j //
page_size]``, slot ``j % page_size``. Each element's capacity is ``N_max = max_blocks * page_size``.

``cache_leftpad (B,)`` marks the first ``cache_leftpad[b]`` slots of element ``b`` as padding: its valid
keys are ``[cache_leftpad[b], L_b)``. The checks that need no look at a tensor's values run for every
call; the ones that read values (the block ids a step uses, the padding against the lengths) run only on
tensors already on the host, so a decode loop on CUDA never waits for the GPU (the kernel clamps them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._validate.inputs import shape_str
from ..errors import AttentionTypeError, AttentionValueError, BackendUnavailableError

_INDEX_DTYPES = (torch.int32, torch.int64)


def _index_tensor(name: str, t: object, want: str, device: torch.device) -> Tensor:
    """An int32/int64 tensor on ``device`` (its shape is the caller's to check)."""
    if not isinstance(t, Tensor):
        raise AttentionTypeError(f"{name} must be an int32 torch.Tensor of shape {want}, got {type(t).__name__}")
    if t.dtype not in _INDEX_DTYPES:
        raise AttentionTypeError(f"{name} must be int32 (or int64), got {t.dtype} with shape {shape_str(t)}")
    if t.device != device:
        raise AttentionValueError(f"{name} is on {t.device} but q is on {device}")
    return t


def check_block_table(block_table: object, B: int, device: torch.device) -> Tensor | None:
    """``block_table``: None (contiguous caches), or an int32/int64 ``(B, max_blocks)`` tensor on ``q``'s
    device, row ``b`` the page ids of batch element ``b`` in key order."""
    if block_table is None:
        return None
    want = f"({B}, max_blocks)"
    t = _index_tensor("block_table", block_table, want, device)
    if t.dim() != 2 or t.shape[0] != B:
        raise AttentionValueError(
            f"block_table must have shape {want} (one row of page ids per batch element of q), got {shape_str(t)}"
        )
    return t


def check_cache_leftpad(cache_leftpad: object, B: int, device: torch.device) -> Tensor | None:
    """``cache_leftpad``: None, or an int32/int64 ``(B,)`` tensor on ``q``'s device (padding slots at the
    start of each batch element's cache)."""
    if cache_leftpad is None:
        return None
    t = _index_tensor("cache_leftpad", cache_leftpad, f"({B},)", device)
    if tuple(t.shape) != (B,):
        raise AttentionValueError(
            f"cache_leftpad must have shape ({B},) (one padding length per batch element of q), got {shape_str(t)}"
        )
    return t


def check_page_shapes(k_cache: Tensor, block_table: Tensor) -> tuple[int, int]:
    """``(page_size, N_max)`` of a paged pool ``k_cache (num_blocks, H_kv, page_size, D)`` read through
    ``block_table (B, max_blocks)``: pages of at least one slot, ``N_max = max_blocks * page_size``."""
    page_size = k_cache.shape[2]
    if page_size < 1:
        raise AttentionValueError(
            f"with block_table, k_cache is (num_blocks, H_kv, page_size, D) and page_size must be at least 1, "
            f"got k_cache {shape_str(k_cache)}"
        )
    return page_size, block_table.shape[1] * page_size


def check_block_ids(block_table: Tensor, L: list[int], page_size: int, num_blocks: int) -> None:
    """The pages a step reads or writes exist: ``block_table[b, p]`` in ``[0, num_blocks)`` for the pages
    ``p < ceil(L_b / page_size)`` of each batch element (``L_b`` its keys after the step). Entries past
    them are never read and may hold anything. Reads the table's values: a host tensor only."""
    if not L:
        return
    used = torch.tensor([-(-n // page_size) for n in L])  # (B,): ceil(L_b / page_size) pages each
    cols = torch.arange(block_table.shape[1])  # (max_blocks,)
    ids = block_table.long()
    bad = (cols[None, :] < used[:, None]) & ((ids < 0) | (ids >= num_blocks))  # (B, max_blocks)
    if bool(bad.any()):
        b, p = (int(i) for i in bad.nonzero()[0])
        raise AttentionValueError(
            f"block_table[{b}, {p}] = {int(ids[b, p])} is not a page of the caches: the step reads pages "
            f"[0, {int(used[b])}) of batch element {b} (L_b = {L[b]} keys, page_size = {page_size}), and their "
            f"ids must lie in [0, num_blocks) = [0, {num_blocks}) (num_blocks = k_cache.shape[0])"
        )


def check_leftpad_values(cache_leftpad: Tensor, lengths: list[int]) -> list[int]:
    """``0 <= cache_leftpad[b] <= cache_seqlens[b]`` for every batch element (the padding lies inside the
    cached entries), read on the host; returns the padding lengths."""
    pads = [int(n) for n in cache_leftpad.tolist()]
    for b, (pad, n) in enumerate(zip(pads, lengths, strict=True)):
        if pad < 0 or pad > n:
            raise AttentionValueError(
                f"cache_leftpad[{b}] = {pad} must lie in [0, cache_seqlens[{b}]] = [0, {n}]: the padding is part "
                "of the cached entries, which cache_seqlens counts from slot 0"
            )
    return pads


def refuse_on_triton_decode(reason: str) -> None:
    """``backend="triton"`` for a decode call its kernel cannot run as asked (``reason``: what the kernel
    ``does not take``, or why it cannot give a gradient): refused by name rather than run without it."""
    raise BackendUnavailableError(
        f"backend='triton' cannot run this decode call: the Triton decode kernel {reason}; pass backend='auto' "
        "or a CPU backend ('online', 'parallel', 'key_major' or 'dense')"
    )
