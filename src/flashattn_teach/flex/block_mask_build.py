"""A block mask classified from a ``mask_mod`` (:func:`flashattn_teach.create_block_mask`'s work): the tile
kinds from :func:`~flashattn_teach.flex.classify.tile_visibility`'s ``(some, every)`` visible elements per
tile (:func:`kinds_from_visibility`), or from the CUDA kernel, made a
:class:`~flashattn_teach.flex.block_mask.BlockMask` (:func:`classified_block_mask`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .block_mask import BlockMask
from .classify import MaskMod, Pool, tile_visibility
from .mods import KIND_FULL, KIND_PARTIAL, KIND_SKIP


def classified_block_mask(
    mask_mod: MaskMod,
    B: int,
    H: int,
    Q_LEN: int,
    KV_LEN: int,
    block: tuple[int, int],
    device: torch.device,
    *,
    kinds: Tensor | None = None,
    separate_full_blocks: bool = True,
    pool: Pool | None = None,
) -> BlockMask:
    """The block mask of checked arguments: ``kinds`` if already classified (the CUDA kernel's), else
    classified here with torch ops, chunk by chunk of tiles (:func:`~flashattn_teach.flex.classify.tile_visibility`)."""
    if kinds is None:
        some, every = tile_visibility(mask_mod, B, H, Q_LEN, KV_LEN, block[0], block[1], device, pool=pool)
        kinds = kinds_from_visibility(some, every)
    if not separate_full_blocks:
        kinds = torch.where(kinds == KIND_FULL, KIND_PARTIAL, kinds).to(torch.int8)
    return BlockMask(kinds, (Q_LEN, KV_LEN), block, mask_mod, batch_shape=(B, H), has_full=separate_full_blocks)


def kinds_from_visibility(some: Tensor, every: Tensor) -> Tensor:
    """int8 kinds from :func:`~flashattn_teach.flex.classify.tile_visibility`'s ``(some, every)``."""
    kinds = torch.where(every, KIND_FULL, torch.where(some, KIND_PARTIAL, KIND_SKIP))
    return kinds.to(torch.int8)


__all__ = ["classified_block_mask", "kinds_from_visibility"]
