"""torch's index lists of a block mask (:class:`flashattn_teach.flex.block_mask.BlockMask`), to and from the
table of tile kinds: per query block the count of its key blocks and the blocks, ascending, then the others.

:func:`ordered` writes the lists of a 0/1 table as torch orders them, :func:`listed` and :func:`kinds_of_lists`
read them back, :func:`cut` is torch's ``_adjust`` of the lists, :func:`keep_dim` torch's reading of an int
index (the dim kept).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import AttentionValueError, BlockMaskListsError
from .mods import KIND_FULL, KIND_PARTIAL


def ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
    """``(num_blocks, indices)`` of a 0/1 table ``(..., rows, cols)``, torch's index lists: per row the
    count of ones, and the columns holding them in ascending order followed by the others (a stable sort)."""
    dense = dense.to(torch.int32)
    num_blocks = dense.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return num_blocks.contiguous(), indices.contiguous()


def listed(num_blocks: Tensor, indices: Tensor) -> Tensor:
    """bool ``(*batch, T_r, T_c)``: True at the first ``num_blocks`` column indices listed per row."""
    T_c = indices.shape[-1]
    valid = torch.arange(T_c, device=indices.device) < num_blocks.unsqueeze(-1)  # (*batch, T_r, T_c)
    # an index past its row's count, or past the table (torch's cut lists can hold one), is written to a
    # spare column T_c, then dropped
    valid &= (indices >= 0) & (indices < T_c)
    target = torch.where(valid, indices.to(torch.int64), T_c)
    table = torch.zeros(*indices.shape[:-1], T_c + 1, dtype=torch.bool, device=indices.device)
    return table.scatter(-1, target, True)[..., :T_c]


def kinds_of_lists(
    kv_num_blocks: Tensor, kv_indices: Tensor, full_kv_num_blocks: Tensor | None, full_kv_indices: Tensor | None
) -> tuple[Tensor, tuple[int, ...]]:
    """int8 kinds ``(B|1, H|1, T_r, T_c)`` and the batch shape of torch's index lists, checked."""
    if (full_kv_num_blocks is None) != (full_kv_indices is None):
        raise BlockMaskListsError("BlockMask: give both full_kv_num_blocks and full_kv_indices, or neither")
    if not 2 <= kv_indices.dim() <= 4 or tuple(kv_num_blocks.shape) != tuple(kv_indices.shape[:-1]):
        raise AttentionValueError(
            f"BlockMask: kv_indices must be (*batch, T_r, T_c) with at most two batch dims and kv_num_blocks "
            f"(*batch, T_r); got kv_indices {tuple(kv_indices.shape)}, kv_num_blocks {tuple(kv_num_blocks.shape)}"
        )
    *batch, T_r, T_c = kv_indices.shape
    partial = listed(kv_num_blocks, kv_indices)
    kinds = partial.to(torch.int8) * KIND_PARTIAL
    if full_kv_num_blocks is not None and full_kv_indices is not None:
        if tuple(full_kv_indices.shape) != tuple(kv_indices.shape) or full_kv_num_blocks.shape != kv_num_blocks.shape:
            raise AttentionValueError(
                f"BlockMask: full_kv_indices {tuple(full_kv_indices.shape)} and full_kv_num_blocks "
                f"{tuple(full_kv_num_blocks.shape)} must have the shapes of kv_indices {tuple(kv_indices.shape)} "
                f"and kv_num_blocks {tuple(kv_num_blocks.shape)}"
            )
        full = listed(full_kv_num_blocks, full_kv_indices)
        if bool((full & partial).any()):
            raise AttentionValueError(
                "BlockMask: a block is listed both in kv_indices and in full_kv_indices; "
                "list each block once (FULL blocks only in full_kv_indices)"
            )
        kinds = torch.where(full, KIND_FULL, kinds).to(torch.int8)
    return kinds.reshape((1,) * (2 - len(batch)) + (*batch, T_r, T_c)), tuple(batch)


def cut(num_blocks: Tensor, indices: Tensor, rows: int, cols: int) -> tuple[Tensor, Tensor]:
    """torch's cut of index lists to the first ``rows x cols`` blocks: the first ``rows`` rows and the first
    ``cols`` entries of each, counted again as the entries below ``min(count, cols)`` (torch's rule, kept so
    the lists equal torch's; it can keep an entry past the cut, which reading the kinds drops)."""
    indices = indices[..., :rows, :cols]
    limit = num_blocks[..., :rows].clamp(max=cols)
    return (indices < limit.unsqueeze(-1)).sum(dim=-1, dtype=torch.int32), indices


def keep_dim(i: int, n: int, dim: int) -> slice:
    """An int index as torch's BlockMask reads it: the slice ``i:i+1`` (negative from the end); one past the
    dim is refused here (torch would return an empty mask)."""
    if not -n <= i < n:
        raise IndexError(f"block_mask index {i} is out of range for dim {dim} of size {n}")
    i = i + n if i < 0 else i
    return slice(i, i + 1)
