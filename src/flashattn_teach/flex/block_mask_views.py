"""torch's views of a block mask (:class:`flashattn_teach.flex.block_mask.BlockMask`): the mask indexed,
``block_mask[b, h, q_blocks]`` (:func:`indexed`), and cut to shorter lengths, ``_adjust`` (:func:`adjusted`).

Both read torch's index lists and build a new mask from the picked or cut lists with the mask's own
``from_kv_blocks``, so the lists of the view are torch's (:mod:`flashattn_teach.flex.index_lists` picks and
cuts them). The mask is read through :class:`Listed`, what the views need of it: ``block_mask.py`` imports
this module, not the other way round.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from torch import Tensor

from ..errors import AttentionValueError
from .classify import MaskMod
from .index_lists import cut, keep_dim

_M = TypeVar("_M", bound="Listed")


class Listed(Protocol):
    """What the views read of a block mask: its sizes, ``mask_mod``, torch's index lists and constructor."""

    @property
    def BLOCK_SIZE(self) -> tuple[int, int]: ...
    @property
    def seq_lengths(self) -> tuple[int, int]: ...
    @property
    def mask_mod(self) -> MaskMod: ...
    @property
    def kv_num_blocks(self) -> Tensor: ...
    @property
    def kv_indices(self) -> Tensor: ...
    @property
    def full_kv_num_blocks(self) -> Tensor | None: ...
    @property
    def full_kv_indices(self) -> Tensor | None: ...
    @property
    def q_indices(self) -> Tensor | None: ...

    def from_kv_blocks(
        self: _M,
        kv_num_blocks: Tensor,
        kv_indices: Tensor,
        full_kv_num_blocks: Tensor | None = ...,
        full_kv_indices: Tensor | None = ...,
        BLOCK_SIZE: int | tuple[int, int] = ...,
        mask_mod: MaskMod | None = ...,
        seq_lengths: tuple[int, int] | None = ...,
        compute_q_blocks: bool = ...,
    ) -> _M: ...


def _sliced_mask_mod_error(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """The ``mask_mod`` of an indexed mask (torch's name): the indices it would see are the sliced mask's,
    not the original's, so it refuses to run until the caller says which function to use."""
    raise AttentionValueError(
        "Cannot use mask_mod from a sliced BlockMask: this BlockMask was indexed (block_mask[...]), which "
        "resets its mask_mod, as torch's does: assign one "
        "from the original mask, sliced.mask_mod = original.mask_mod (offset by the indices the slice "
        "starts at when the function reads b, h or q_idx)"
    )


def indexed(mask: _M, index: int | slice | Tensor | tuple[Any, ...]) -> _M:
    """torch's indexing: ``index`` picks from the lists' first three dims (batch, head, query block);
    an int ``i`` keeps its dim (it reads as ``i:i+1``), as torch's does. The result has the same
    ``seq_lengths`` and a ``mask_mod`` that refuses to run until one is assigned, as torch's."""
    index = index if isinstance(index, tuple) else (index,)
    sizes = tuple(mask.kv_num_blocks.shape)
    if len(sizes) != 3:
        raise AttentionValueError(
            f"block_mask[...] indexes (batch, head, query block) of lists (B, H, T_r), but this mask's "
            f"kv_num_blocks is {sizes}: index the mask it was taken from, or build it with B and H"
        )
    padded = (*index, slice(None), slice(None), slice(None))[:3]
    picks = tuple(
        keep_dim(i, n, dim) if isinstance(i, int) else i for dim, (i, n) in enumerate(zip(padded, sizes, strict=True))
    )
    full = mask.full_kv_num_blocks, mask.full_kv_indices
    return mask.from_kv_blocks(
        mask.kv_num_blocks[picks],
        mask.kv_indices[picks],
        None if full[0] is None else full[0][picks],
        None if full[1] is None else full[1][picks],
        BLOCK_SIZE=mask.BLOCK_SIZE,
        mask_mod=_sliced_mask_mod_error,
        seq_lengths=mask.seq_lengths,
        compute_q_blocks=mask.q_indices is not None,
    )


def adjusted(mask: _M, new_q_len: int, new_kv_len: int) -> _M:
    """torch's ``_adjust``: the mask for ``(new_q_len, new_kv_len)``, its lists cut to the upper left
    ``ceil(new_q_len / BLOCK_SIZE[0]) x ceil(new_kv_len / BLOCK_SIZE[1])`` blocks (never extended: a
    longer length than the lists cover is refused when the attention reads them)."""
    rows, cols = -(-new_q_len // mask.BLOCK_SIZE[0]), -(-new_kv_len // mask.BLOCK_SIZE[1])  # ceil
    kv_num_blocks, kv_indices = cut(mask.kv_num_blocks, mask.kv_indices, rows, cols)
    full_num_blocks, full_indices = (
        (None, None)
        if mask.full_kv_num_blocks is None or mask.full_kv_indices is None
        else cut(mask.full_kv_num_blocks, mask.full_kv_indices, rows, cols)
    )
    return mask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        full_num_blocks,
        full_indices,
        BLOCK_SIZE=mask.BLOCK_SIZE,
        mask_mod=mask.mask_mod,
        seq_lengths=(new_q_len, new_kv_len),
        compute_q_blocks=mask.q_indices is not None,
    )


__all__ = ["Listed", "adjusted", "indexed"]
