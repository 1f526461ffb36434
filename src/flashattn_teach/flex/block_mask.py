"""FlexAttention's block mask, kept as one table of tile kinds: :class:`BlockMask` (built by
:func:`flashattn_teach.create_block_mask`, :mod:`flashattn_teach.api.block_mask`).

A block mask (Dong et al. 2024, "Flex Attention", sec. 3.3) says, for each ``BLOCK_SIZE[0] x BLOCK_SIZE[1]``
tile ``(i, j)`` of each (b, h), whether no element of it is visible (SKIP: never computed), every element is
(FULL: computed without ``mask_mod``) or some are (PARTIAL: computed with ``mask_mod``). torch stores it as
sorted index lists, per query block the key blocks to visit:

    kv_num_blocks[b, h, i]          number of PARTIAL key blocks of query block i
    kv_indices[b, h, i, :]          those blocks first, ascending, then the other blocks (never read)
    full_kv_num_blocks, full_kv_indices     the same for FULL blocks
    q_num_blocks, q_indices, full_q_*       the transposed lists (per key block, its query blocks): the
                                            backward's dK/dV loop reads them

Here the source of truth is :attr:`BlockMask.block_kinds`, int8 ``(B|1, H|1, T_r, T_c)`` with the codes
``KIND_SKIP, KIND_PARTIAL, KIND_FULL = 0, 1, 2``; torch's lists are derived from it on first use, exactly as
torch orders them (:mod:`flashattn_teach.flex.index_lists` writes and reads them). A dim of size 1 in
``block_kinds`` is a broadcast: the mask is the same for every batch element (head), and torch's attributes
are expanded to the requested ``B`` (``H``).

:func:`create_block_mask` never builds the ``N_q x N_k`` mask: it evaluates ``mask_mod`` chunk by chunk of
tiles (:mod:`flashattn_teach.flex.classify`; on CUDA, a Triton kernel running the translated function,
:mod:`flashattn_teach.triton.block_mask`).

torch's API is kept: ``BlockMask(seq_lengths=..., kv_num_blocks=..., kv_indices=..., ...)`` and
:meth:`BlockMask.from_kv_blocks` (the given lists stay the mask's attributes), indexing (``block_mask[b]``,
``[:, h]``, ``[b, h, q_blocks]``: every int keeps its dim, as torch's), :meth:`BlockMask._adjust`, ``str``,
``repr`` and :meth:`BlockMask.to_string` drawn as torch draws them. The index lists are read only (the
attention reads ``block_kinds``); ``mask_mod`` and ``seq_lengths`` may be assigned, as torch's decoding does
after indexing query blocks. Lists that cover more blocks than ``seq_lengths`` needs are read cropped (as
torch's kernel reads them); fewer are refused when the attention reads them. Not provided: the
deterministic-backward ``dq_write_order`` metadata, and more than two batch dims.

This file holds the mask (the kinds, torch's lists derived from them, and the tilings the attention reads);
beside it, one concept each: ``block_mask_args.py`` torch's argument names and checks, ``index_lists.py``
the lists written and read, ``block_mask_views.py`` indexing and ``_adjust``, ``block_mask_draw.py``
``to_string``, ``str`` and ``repr``, ``block_mask_build.py`` a mask classified from a ``mask_mod``.
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from ..errors import AttentionTypeError, AttentionValueError, BlockMaskListsError
from .block_mask_args import (
    DEFAULT_BLOCK_SIZE,
    DQ_METADATA,
    INDEX_LISTS,
    READ_ONLY,
    block_size,
    read_only_error,
    refuse_dq_metadata,
    seq_lengths_pair,
)
from .block_mask_draw import drawing, listing, summary
from .block_mask_views import adjusted, indexed
from .classify import MaskMod, retile
from .combinators import noop_mask
from .index_lists import kinds_of_lists, ordered
from .mods import KIND_FULL, KIND_PARTIAL, KIND_SKIP


class BlockMask:
    """The tile kinds of one mask, ``block_kinds`` int8 ``(B|1, H|1, T_r, T_c)``, and torch's index lists
    derived from them.

    ``seq_lengths = (N_q, N_k)``; ``BLOCK_SIZE = (Q_BLOCK_SIZE, KV_BLOCK_SIZE)``, ``T_r = ceil(N_q /
    BLOCK_SIZE[0])``, ``T_c = ceil(N_k / BLOCK_SIZE[1])``; ``batch_shape``, the leading dims of torch's
    attributes (``(B, H)`` from :func:`create_block_mask`), each equal to the kinds' dim or the kinds' dim
    being 1 (a broadcast); ``has_full``: whether FULL blocks are kept apart (torch's
    ``separate_full_blocks``); without them ``full_kv_*`` and ``full_q_*`` are None.

    torch's constructor is taken by keyword: ``BlockMask(seq_lengths=..., kv_num_blocks=..., kv_indices=...,
    full_kv_num_blocks=..., full_kv_indices=..., q_num_blocks=..., ..., BLOCK_SIZE=..., mask_mod=...)``;
    the lists given are kept as the mask's attributes (the ``q_*`` ones as given, None if not, as torch).
    """

    BLOCK_SIZE: tuple[int, int]
    seq_lengths: tuple[int, int]
    batch_shape: tuple[int, ...]
    has_full: bool
    _kinds: Tensor  # int8 (B|1, H|1, rows, cols): the blocks as built or listed, whatever the lengths
    _tile_kinds: dict[tuple[int, int], Tensor]

    # torch's deterministic-backward metadata: never built here (refused where torch takes it)
    dq_write_order: Tensor | None = None
    dq_write_order_full: Tensor | None = None
    dq_kv_order: Tensor | None = None

    def __init__(
        self,
        block_kinds: Tensor | None = None,
        seq_lengths: tuple[int, int] | None = None,
        BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
        mask_mod: MaskMod | None = None,
        *,
        batch_shape: tuple[int, ...] | None = None,
        has_full: bool = True,
        kv_num_blocks: Tensor | None = None,
        kv_indices: Tensor | None = None,
        full_kv_num_blocks: Tensor | None = None,
        full_kv_indices: Tensor | None = None,
        q_num_blocks: Tensor | None = None,
        q_indices: Tensor | None = None,
        full_q_num_blocks: Tensor | None = None,
        full_q_indices: Tensor | None = None,
        dq_write_order: Tensor | None = None,
        dq_write_order_full: Tensor | None = None,
        dq_kv_order: Tensor | None = None,
        dq_kv_order_spt: bool | None = None,
    ) -> None:
        refuse_dq_metadata("BlockMask", dq_write_order, dq_write_order_full, dq_kv_order)
        if isinstance(block_kinds, (tuple, list)):
            raise AttentionTypeError(
                "BlockMask: the first positional argument is block_kinds (an int8 tensor); torch's form "
                "BlockMask(seq_lengths, kv_num_blocks, kv_indices, ...) is taken by keyword here: "
                "BlockMask(seq_lengths=..., kv_num_blocks=..., kv_indices=..., ...) or BlockMask.from_kv_blocks(...)"
            )
        object.__setattr__(self, "_tile_kinds", {})
        given: dict[str, Tensor | None] = {}
        if kv_num_blocks is not None or kv_indices is not None:  # torch's form: the index lists
            if block_kinds is not None or kv_num_blocks is None or kv_indices is None or seq_lengths is None:
                raise AttentionValueError(
                    "BlockMask: give block_kinds, or torch's seq_lengths=, kv_num_blocks= and kv_indices= "
                    "(with full_kv_num_blocks=, full_kv_indices= for FULL blocks), not a mix"
                )
            if (full_q_num_blocks is None) != (full_q_indices is None):  # torch asserts on this pair too
                raise BlockMaskListsError("BlockMask: give both full_q_num_blocks and full_q_indices, or neither")
            block_kinds, batch_shape = kinds_of_lists(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
            has_full = full_kv_num_blocks is not None
            given = {
                "kv_num_blocks": kv_num_blocks,
                "kv_indices": kv_indices,
                "full_kv_num_blocks": full_kv_num_blocks,
                "full_kv_indices": full_kv_indices,
                "q_num_blocks": q_num_blocks,
                "q_indices": q_indices,
                "full_q_num_blocks": full_q_num_blocks,
                "full_q_indices": full_q_indices,
            }
        elif block_kinds is None or seq_lengths is None:
            raise AttentionTypeError(
                "BlockMask needs block_kinds and seq_lengths, or torch's seq_lengths=, kv_num_blocks= and "
                "kv_indices=; create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN) builds one from a function"
            )
        if block_kinds.dim() != 4 or block_kinds.dtype != torch.int8:
            raise AttentionValueError(
                f"block_kinds must be int8 (B|1, H|1, T_r, T_c), got {block_kinds.dtype} {tuple(block_kinds.shape)}"
            )
        batch_shape = tuple(block_kinds.shape[:2]) if batch_shape is None else tuple(batch_shape)
        padded = (1,) * (2 - len(batch_shape)) + batch_shape
        if len(batch_shape) > 2 or any(k not in (1, n) for k, n in zip(block_kinds.shape[:2], padded, strict=True)):
            raise AttentionValueError(
                f"batch_shape {batch_shape} does not match block_kinds of shape {tuple(block_kinds.shape)}: "
                "give at most (B, H), each equal to the kinds' dim or the kinds' dim being 1"
            )
        if not has_full and bool((block_kinds == KIND_FULL).any()):
            raise AttentionValueError("block_kinds holds FULL blocks but has_full=False: mark them PARTIAL")
        object.__setattr__(self, "BLOCK_SIZE", block_size(BLOCK_SIZE))
        object.__setattr__(self, "_kinds", block_kinds)
        object.__setattr__(self, "batch_shape", batch_shape)
        object.__setattr__(self, "has_full", has_full)
        self.seq_lengths = seq_lengths  # type: ignore[assignment]  # checked and made a pair of ints
        self.mask_mod: MaskMod = mask_mod if mask_mod is not None else noop_mask
        vars(self).update(given)

    # torch's index lists, derived on first use (or kept as given); read only, since the attention reads
    # block_kinds. seq_lengths and mask_mod may be assigned, as in torch.

    def __setattr__(self, name: str, value: object) -> None:
        if name in READ_ONLY:
            raise read_only_error(name)
        if name in DQ_METADATA:
            refuse_dq_metadata("BlockMask", *(value if n == name else None for n in DQ_METADATA))
        if name == "seq_lengths":
            value = seq_lengths_pair(value)
            self._tile_kinds.clear()  # the tilings are of the lengths
        super().__setattr__(name, value)

    @property
    def block_kinds(self) -> Tensor:
        """int8 ``(B|1, H|1, ceil(N_q / BLOCK_SIZE[0]), ceil(N_k / BLOCK_SIZE[1]))``: the kinds the attention
        reads. Lists that cover more blocks (a mask given shorter ``seq_lengths``) are read cropped to the
        upper left, as torch's kernel reads only the blocks its lengths reach; fewer are refused."""
        kinds = self._kinds
        need = (-(-self.seq_lengths[0] // self.BLOCK_SIZE[0]), -(-self.seq_lengths[1] // self.BLOCK_SIZE[1]))
        have = tuple(kinds.shape[2:])
        if need[0] > have[0] or need[1] > have[1]:
            raise AttentionValueError(
                f"block_mask holds {have[0]} x {have[1]} blocks of {self.BLOCK_SIZE}, but its seq_lengths "
                f"{self.seq_lengths} need {need[0]} x {need[1]}: set block_mask.seq_lengths to the lengths the "
                "blocks cover (after indexing query blocks, block_mask[:, :, i], as torch's decoding does: "
                "(rows, KV_LEN)), or build the mask for these lengths with create_block_mask"
            )
        return kinds if need == have else kinds[:, :, : need[0], : need[1]]

    @block_kinds.setter
    def block_kinds(self, value: Tensor) -> None:
        raise read_only_error("block_kinds")

    def _expanded(self, kind: int, *, transpose: bool = False) -> Tensor:
        """0/1 int32 table of blocks of one kind, at ``batch_shape`` (query blocks last if ``transpose``)."""
        table = (self._kinds == kind).to(torch.int32)
        if transpose:
            table = table.transpose(-2, -1)
        padded = (1,) * (2 - len(self.batch_shape)) + self.batch_shape
        return table.expand(*padded, *table.shape[2:]).reshape(*self.batch_shape, *table.shape[2:])

    @cached_property
    def _kv_lists(self) -> tuple[Tensor, Tensor]:
        return ordered(self._expanded(KIND_PARTIAL))

    @cached_property
    def _full_kv_lists(self) -> tuple[Tensor, Tensor] | None:
        return ordered(self._expanded(KIND_FULL)) if self.has_full else None

    @cached_property
    def _q_lists(self) -> tuple[Tensor, Tensor]:
        return ordered(self._expanded(KIND_PARTIAL, transpose=True))

    @cached_property
    def _full_q_lists(self) -> tuple[Tensor, Tensor] | None:
        return ordered(self._expanded(KIND_FULL, transpose=True)) if self.has_full else None

    @cached_property
    def kv_num_blocks(self) -> Tensor:
        """int32 ``(*batch_shape, T_r)``: PARTIAL key blocks per query block."""
        return self._kv_lists[0]

    @cached_property
    def kv_indices(self) -> Tensor:
        """int32 ``(*batch_shape, T_r, T_c)``: the PARTIAL key blocks of each query block first, ascending."""
        return self._kv_lists[1]

    @cached_property
    def full_kv_num_blocks(self) -> Tensor | None:
        """int32 ``(*batch_shape, T_r)``: FULL key blocks per query block (None without ``has_full``)."""
        return None if self._full_kv_lists is None else self._full_kv_lists[0]

    @cached_property
    def full_kv_indices(self) -> Tensor | None:
        """int32 ``(*batch_shape, T_r, T_c)``: the FULL key blocks of each query block first, ascending."""
        return None if self._full_kv_lists is None else self._full_kv_lists[1]

    @cached_property
    def q_num_blocks(self) -> Tensor | None:
        """int32 ``(*batch_shape, T_c)``: PARTIAL query blocks per key block."""
        return self._q_lists[0]

    @cached_property
    def q_indices(self) -> Tensor | None:
        """int32 ``(*batch_shape, T_c, T_r)``: the PARTIAL query blocks of each key block first, ascending."""
        return self._q_lists[1]

    @cached_property
    def full_q_num_blocks(self) -> Tensor | None:
        """int32 ``(*batch_shape, T_c)``: FULL query blocks per key block (None without ``has_full``)."""
        return None if self._full_q_lists is None else self._full_q_lists[0]

    @cached_property
    def full_q_indices(self) -> Tensor | None:
        """int32 ``(*batch_shape, T_c, T_r)``: the FULL query blocks of each key block first, ascending."""
        return None if self._full_q_lists is None else self._full_q_lists[1]

    @classmethod
    def from_kv_blocks(
        cls,
        kv_num_blocks: Tensor,
        kv_indices: Tensor,
        full_kv_num_blocks: Tensor | None = None,
        full_kv_indices: Tensor | None = None,
        BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
        mask_mod: MaskMod | None = None,
        seq_lengths: tuple[int, int] | None = None,
        compute_q_blocks: bool = True,
        *,
        dq_write_order: Tensor | None = None,
        dq_write_order_full: Tensor | None = None,
        dq_kv_order: Tensor | bool | None = None,
    ) -> BlockMask:
        """torch's constructor from index lists: ``kv_indices`` ``(*batch, T_r, T_c)`` (at most two batch dims)
        whose first ``kv_num_blocks`` ``(*batch, T_r)`` entries per row are its PARTIAL key blocks, and
        likewise ``full_kv_*`` for FULL ones. The given tensors are kept as the mask's attributes; the
        transposed ``q_*`` lists are derived (None with ``compute_q_blocks=False``, as torch)."""
        refuse_dq_metadata(
            "BlockMask.from_kv_blocks",
            dq_write_order,
            dq_write_order_full,
            None if dq_kv_order is True else dq_kv_order,
        )
        size = block_size(BLOCK_SIZE)
        if seq_lengths is None:  # torch's default: whole blocks
            seq_lengths = (kv_indices.shape[-2] * size[0], kv_indices.shape[-1] * size[1])
        mask = cls(
            seq_lengths=seq_lengths,
            BLOCK_SIZE=size,
            mask_mod=mask_mod,
            kv_num_blocks=kv_num_blocks,
            kv_indices=kv_indices,
            full_kv_num_blocks=full_kv_num_blocks,
            full_kv_indices=full_kv_indices,
        )
        if compute_q_blocks:  # derived from the kinds on first use, as torch transposes the lists
            for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
                del vars(mask)[name]
        return mask

    # torch's views of the mask

    @property
    def shape(self) -> tuple[int, ...]:
        """``(*batch_shape, N_q, N_k)``."""
        return (*self.batch_shape, *self.seq_lengths)

    def numel(self) -> int:
        return math.prod(self.shape)

    def sparsity(self) -> float:
        """torch's figure: 100 (1 - computed / numel), computed = the listed blocks x the block's area (so a
        ragged last block counts whole and the figure can go below 0)."""
        computed = int(self.kv_num_blocks.sum())
        if self.full_kv_num_blocks is not None:
            computed += int(self.full_kv_num_blocks.sum())
        return 100 * (1 - computed * self.BLOCK_SIZE[0] * self.BLOCK_SIZE[1] / self.numel())

    def to_dense(self) -> Tensor:
        """int32 ``(*batch_shape, T_r, T_c)``: 1 for every block computed (PARTIAL or FULL), as torch's."""
        return self._expanded(KIND_PARTIAL) | self._expanded(KIND_FULL)

    def to(self, device: torch.device | str) -> BlockMask:
        """The same mask with its kinds and lists on ``device``."""
        moved = BlockMask(
            self._kinds.to(device),
            self.seq_lengths,
            self.BLOCK_SIZE,
            self.mask_mod,
            batch_shape=self.batch_shape,
            has_full=self.has_full,
        )
        lists = {name: value for name, value in vars(self).items() if name in INDEX_LISTS}
        vars(moved).update({name: None if t is None else t.to(device) for name, t in lists.items()})
        return moved

    def __getitem__(self, index: int | slice | Tensor | tuple[Any, ...]) -> BlockMask:
        """torch's indexing of (batch, head, query block); an int keeps its dim (:func:`.block_mask_views.indexed`)."""
        return indexed(self, index)

    def _adjust(self, new_q_len: int, new_kv_len: int) -> BlockMask:
        """torch's ``_adjust``: the lists cut to the new lengths (:func:`.block_mask_views.adjusted`)."""
        return adjusted(self, new_q_len, new_kv_len)

    def to_string(self, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
        """torch's drawing of :meth:`to_dense` (:func:`.block_mask_draw.drawing`)."""
        return drawing(self.to_dense(), grid_size, limit)

    def __str__(self) -> str:
        return summary(self.shape, self.sparsity(), self.to_string())

    def __repr__(self) -> str:
        lists = {name: getattr(self, name) for name in INDEX_LISTS}
        return listing(lists, self.BLOCK_SIZE, self.shape, self.sparsity(), self.mask_mod)

    # ours: the kinds at another tiling, and the element-level visibility of a tile region

    def tile_kinds(self, block_m: int, block_n: int) -> Tensor:
        """int8 ``(B|1, H|1, ceil(N_q / block_m), ceil(N_k / block_n))``: the kind of each ``block_m x block_n``
        tile, conservative: SKIP iff every block it overlaps is SKIP, FULL iff every one is FULL, else PARTIAL.
        Cached per tiling; on the mask's device; O(blocks + tiles) work by 2-D prefix sums."""
        key = (int(block_m), int(block_n))
        if key not in self._tile_kinds:
            if block_m <= 0 or block_n <= 0:
                raise AttentionValueError(f"tile_kinds: block_m and block_n must be positive, got {key}")
            self._tile_kinds[key] = retile(self.block_kinds, self.seq_lengths, self.BLOCK_SIZE, *key)
        return self._tile_kinds[key]

    def _element_kinds(self, r0: int, r1: int, c0: int, c1: int) -> Tensor:
        """int8 ``(B|1, H|1, r1 - r0, c1 - c0)``: each element's block kind."""
        N_q, N_k = self.seq_lengths
        if not (0 <= r0 <= r1 <= N_q and 0 <= c0 <= c1 <= N_k):
            raise AttentionValueError(
                f"tile region rows [{r0}, {r1}) x columns [{c0}, {c1}) is outside the mask's "
                f"seq_lengths ({N_q}, {N_k}): clip it to the sequences"
            )
        device = self.block_kinds.device
        rows = torch.arange(r0, r1, device=device) // self.BLOCK_SIZE[0]
        cols = torch.arange(c0, c1, device=device) // self.BLOCK_SIZE[1]
        return self.block_kinds.index_select(2, rows).index_select(3, cols)

    def visible_blocks(self, r0: int, r1: int, c0: int, c1: int) -> Tensor:
        """bool ``(B|1, H|1, r1 - r0, c1 - c0)``: True where the element's block is not SKIP."""
        return self._element_kinds(r0, r1, c0, c1) != KIND_SKIP

    def full_blocks(self, r0: int, r1: int, c0: int, c1: int) -> Tensor:
        """bool ``(B|1, H|1, r1 - r0, c1 - c0)``: True where the element's block is FULL."""
        return self._element_kinds(r0, r1, c0, c1) == KIND_FULL


__all__ = [
    "KIND_FULL",
    "KIND_PARTIAL",
    "KIND_SKIP",
    "BlockMask",
]
