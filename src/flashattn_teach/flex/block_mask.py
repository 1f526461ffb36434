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
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from ..errors import AttentionTypeError, AttentionValueError
from .classify import MaskMod, Pool, retile, tile_visibility
from .combinators import noop_mask
from .index_lists import cut, keep_dim, kinds_of_lists, ordered
from .mods import KIND_FULL, KIND_PARTIAL, KIND_SKIP

# torch's index-list attributes of a block mask, in its order
INDEX_LISTS = tuple(
    "kv_num_blocks kv_indices full_kv_num_blocks full_kv_indices q_num_blocks q_indices full_q_num_blocks "
    "full_q_indices".split()
)
DEFAULT_BLOCK_SIZE = 128  # torch's _DEFAULT_SPARSE_BLOCK_SIZE


def block_size(BLOCK_SIZE: int | tuple[int, int]) -> tuple[int, int]:
    size = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    if len(size) != 2 or not all(isinstance(s, int) and s > 0 for s in size):
        raise AttentionValueError(
            f"BLOCK_SIZE must be a positive int or a pair (Q_BLOCK_SIZE, KV_BLOCK_SIZE) of them, got {BLOCK_SIZE!r}"
        )
    return size[0], size[1]


# what torch's BlockMask exposes and this one derives from block_kinds: assigning them would change nothing
READ_ONLY = (*INDEX_LISTS, "BLOCK_SIZE", "shape", "batch_shape", "has_full")
DQ_METADATA = ("dq_write_order", "dq_write_order_full", "dq_kv_order")


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _sliced_mask_mod_error(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """The ``mask_mod`` of an indexed mask (torch's name): the indices it would see are the sliced mask's,
    not the original's, so it refuses to run until the caller says which function to use."""
    raise AttentionValueError(
        "this BlockMask was indexed (block_mask[...]), which resets its mask_mod, as torch's does: assign one "
        "from the original mask, sliced.mask_mod = original.mask_mod (offset by the indices the slice "
        "starts at when the function reads b, h or q_idx)"
    )


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
        _refuse_dq_metadata("BlockMask", dq_write_order, dq_write_order_full, dq_kv_order)
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
            raise _read_only(name)
        if name in DQ_METADATA:
            _refuse_dq_metadata("BlockMask", *(value if n == name else None for n in DQ_METADATA))
        if name == "seq_lengths":
            value = _seq_lengths(value)
            self._tile_kinds.clear()  # the tilings are of the lengths
        super().__setattr__(name, value)

    @property
    def block_kinds(self) -> Tensor:
        """int8 ``(B|1, H|1, ceil(N_q / BLOCK_SIZE[0]), ceil(N_k / BLOCK_SIZE[1]))``: the kinds the attention
        reads. Lists that cover more blocks (a mask given shorter ``seq_lengths``) are read cropped to the
        upper left, as torch's kernel reads only the blocks its lengths reach; fewer are refused."""
        kinds = self._kinds
        need = (_cdiv(self.seq_lengths[0], self.BLOCK_SIZE[0]), _cdiv(self.seq_lengths[1], self.BLOCK_SIZE[1]))
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
        raise _read_only("block_kinds")

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
        _refuse_dq_metadata(
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
        """torch's indexing: ``index`` picks from the lists' first three dims (batch, head, query block);
        an int ``i`` keeps its dim (it reads as ``i:i+1``), as torch's does. The result has the same
        ``seq_lengths`` and a ``mask_mod`` that refuses to run until one is assigned, as torch's."""
        index = index if isinstance(index, tuple) else (index,)
        sizes = tuple(self.kv_num_blocks.shape)
        if len(sizes) != 3:
            raise AttentionValueError(
                f"block_mask[...] indexes (batch, head, query block) of lists (B, H, T_r), but this mask's "
                f"kv_num_blocks is {sizes}: index the mask it was taken from, or build it with B and H"
            )
        padded = (*index, slice(None), slice(None), slice(None))[:3]
        picks = tuple(
            keep_dim(i, n, dim) if isinstance(i, int) else i
            for dim, (i, n) in enumerate(zip(padded, sizes, strict=True))
        )
        full = self.full_kv_num_blocks, self.full_kv_indices
        return BlockMask.from_kv_blocks(
            self.kv_num_blocks[picks],
            self.kv_indices[picks],
            None if full[0] is None else full[0][picks],
            None if full[1] is None else full[1][picks],
            BLOCK_SIZE=self.BLOCK_SIZE,
            mask_mod=_sliced_mask_mod_error,
            seq_lengths=self.seq_lengths,
            compute_q_blocks=self.q_indices is not None,
        )

    def _adjust(self, new_q_len: int, new_kv_len: int) -> BlockMask:
        """torch's ``_adjust``: the mask for ``(new_q_len, new_kv_len)``, its lists cut to the upper left
        ``ceil(new_q_len / BLOCK_SIZE[0]) x ceil(new_kv_len / BLOCK_SIZE[1])`` blocks (never extended: a
        longer length than the lists cover is refused when the attention reads them)."""
        rows, cols = _cdiv(new_q_len, self.BLOCK_SIZE[0]), _cdiv(new_kv_len, self.BLOCK_SIZE[1])
        kv_num_blocks, kv_indices = cut(self.kv_num_blocks, self.kv_indices, rows, cols)
        full_num_blocks, full_indices = (
            (None, None)
            if self.full_kv_num_blocks is None or self.full_kv_indices is None
            else cut(self.full_kv_num_blocks, self.full_kv_indices, rows, cols)
        )
        return BlockMask.from_kv_blocks(
            kv_num_blocks,
            kv_indices,
            full_num_blocks,
            full_indices,
            BLOCK_SIZE=self.BLOCK_SIZE,
            mask_mod=self.mask_mod,
            seq_lengths=(new_q_len, new_kv_len),
            compute_q_blocks=self.q_indices is not None,
        )

    def to_string(self, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
        """torch's drawing of the first ``limit`` (b, h) of :meth:`to_dense`, each headed by its index tuple:
        at most ``grid_size`` cells a side (-1: one cell per block), each two characters, '██' if every block
        it covers is computed, '  ' if none is, '░░' otherwise."""
        dense = self.to_dense().cpu()
        *batch, T_r, T_c = dense.shape
        rows, cols = (grid_size, grid_size) if isinstance(grid_size, int) else grid_size
        step_r, step_c = max(1, _cdiv(T_r, rows)), max(1, _cdiv(T_c, cols))  # a size <= 0 gives steps of 1
        pictures = []
        for n, where in enumerate(itertools.product(*(range(d) for d in batch))):
            if n == limit:
                pictures += [
                    "...",
                    "To print out more, set BlockMask.to_string(limit=N)",
                    "You can also index (BlockMask[batch, head]) to choose a specific batch or head",
                ]
                break
            table = dense[where]
            lines = [str(where)]
            for r in range(0, T_r, step_r):
                lines.append("".join(_cell(table[r : r + step_r, c : c + step_c]) for c in range(0, T_c, step_c)))
            pictures.append("\n".join(lines) + "\n")
        return "\n".join(pictures)

    def __str__(self) -> str:
        return f"BlockMask(shape={self.shape}, sparsity={self.sparsity():.2f}%, \n{self.to_string().strip()}\n)"

    def __repr__(self) -> str:
        def size(name: str) -> object:
            value = getattr(self, name)
            return None if value is None else value.shape

        lists = "".join(f"    {name}={size(name)},\n" for name in INDEX_LISTS)
        name = getattr(self.mask_mod, "__name__", self.mask_mod)
        return (
            f"BlockMask(\n{lists}    BLOCK_SIZE={self.BLOCK_SIZE},\n    shape={self.shape},\n"
            f"    sparsity={self.sparsity():.2f}%,\n    mask_mod={name}\n)"
        )

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


def _read_only(name: str) -> AttributeError:
    return AttributeError(
        f"BlockMask.{name} is read only: the attention reads the block kinds the mask was built with, so "
        "setting it would change nothing; build a new mask with BlockMask.from_kv_blocks(...) from the "
        "lists you want, or with create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN)"
    )


def _refuse_dq_metadata(where: str, *values: object) -> None:
    for name, value in zip(DQ_METADATA, values, strict=True):
        if value is not None:
            raise AttentionValueError(
                f"{where}: {name} (torch's deterministic dQ write order) is not supported here; leave {name}=None"
            )


def _seq_lengths(value: object) -> tuple[int, int]:
    if (
        not isinstance(value, Sequence)
        or len(value) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value)
    ):
        raise AttentionValueError(f"BlockMask.seq_lengths must be a pair (Q_LEN, KV_LEN) of ints >= 0, got {value!r}")
    return (int(value[0]), int(value[1]))


def _cell(section: Tensor) -> str:
    """One cell of torch's drawing: its share of computed blocks as full, empty or shaded."""
    share = float(section.to(torch.float32).mean())
    return "██" if share == 1 else "  " if share == 0 else "░░"


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


__all__ = [
    "KIND_FULL",
    "KIND_PARTIAL",
    "KIND_SKIP",
    "BlockMask",
    "block_size",
    "classified_block_mask",
    "kinds_from_visibility",
]
