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
torch orders them. A dim of size 1 in ``block_kinds`` is a broadcast: the mask is the same for every batch
element (head), and torch's attributes are expanded to the requested ``B`` (``H``).

:func:`create_block_mask` never builds the ``N_q x N_k`` mask: it evaluates ``mask_mod`` chunk by chunk of
tiles (:mod:`flashattn_teach.flex.classify`; on CUDA, a Triton kernel running the translated function,
:mod:`flashattn_teach.triton.block_mask`).

Differences from torch: the constructor takes ``block_kinds`` (use :meth:`BlockMask.from_kv_blocks` for
torch's index lists); indexing (``block_mask[b, h]``), ``_adjust`` and the deterministic-backward
``dq_write_order`` metadata are not provided; ``to_string`` draws FULL, PARTIAL and SKIP blocks apart.
"""

from __future__ import annotations

import itertools
import math
from functools import cached_property

import torch
from torch import Tensor

from ..errors import AttentionValueError
from .classify import MaskMod, Pool, retile, tile_visibility
from .combinators import noop_mask
from .mods import KIND_FULL, KIND_PARTIAL, KIND_SKIP

# torch's index-list attributes of a block mask, in its order
INDEX_LISTS = tuple(
    "kv_num_blocks kv_indices full_kv_num_blocks full_kv_indices q_num_blocks q_indices full_q_num_blocks "
    "full_q_indices".split()
)
DEFAULT_BLOCK_SIZE = 128  # torch's _DEFAULT_SPARSE_BLOCK_SIZE


def _ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
    """``(num_blocks, indices)`` of a 0/1 table ``(..., rows, cols)``, torch's index lists: per row the
    count of ones, and the columns holding them in ascending order followed by the others (a stable sort)."""
    dense = dense.to(torch.int32)
    num_blocks = dense.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return num_blocks.contiguous(), indices.contiguous()


def block_size(BLOCK_SIZE: int | tuple[int, int]) -> tuple[int, int]:
    size = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    if len(size) != 2 or not all(isinstance(s, int) and s > 0 for s in size):
        raise AttentionValueError(
            f"BLOCK_SIZE must be a positive int or a pair (Q_BLOCK_SIZE, KV_BLOCK_SIZE) of them, got {BLOCK_SIZE!r}"
        )
    return size[0], size[1]


class BlockMask:
    """The tile kinds of one mask, ``block_kinds`` int8 ``(B|1, H|1, T_r, T_c)``, and torch's index lists
    derived from them.

    ``seq_lengths = (N_q, N_k)``; ``BLOCK_SIZE = (Q_BLOCK_SIZE, KV_BLOCK_SIZE)``, ``T_r = ceil(N_q /
    BLOCK_SIZE[0])``, ``T_c = ceil(N_k / BLOCK_SIZE[1])``; ``batch_shape``, the leading dims of torch's
    attributes (``(B, H)`` from :func:`create_block_mask`), each equal to the kinds' dim or the kinds' dim
    being 1 (a broadcast); ``has_full``: whether FULL blocks are kept apart (torch's
    ``separate_full_blocks``); without them ``full_kv_*`` and ``full_q_*`` are None.
    """

    def __init__(
        self,
        block_kinds: Tensor,
        seq_lengths: tuple[int, int],
        BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
        mask_mod: MaskMod | None = None,
        *,
        batch_shape: tuple[int, ...] | None = None,
        has_full: bool = True,
    ) -> None:
        self.BLOCK_SIZE = block_size(BLOCK_SIZE)
        self.seq_lengths = (int(seq_lengths[0]), int(seq_lengths[1]))
        T_r, T_c = (-(-n // s) for n, s in zip(self.seq_lengths, self.BLOCK_SIZE, strict=True))
        if block_kinds.dim() != 4 or block_kinds.dtype != torch.int8 or tuple(block_kinds.shape[2:]) != (T_r, T_c):
            raise AttentionValueError(
                f"block_kinds must be int8 (B|1, H|1, {T_r}, {T_c}) for seq_lengths {self.seq_lengths} and "
                f"BLOCK_SIZE {self.BLOCK_SIZE}, got {block_kinds.dtype} {tuple(block_kinds.shape)}"
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
        self.block_kinds = block_kinds
        self.batch_shape = batch_shape
        self.has_full = has_full
        self.mask_mod: MaskMod = mask_mod if mask_mod is not None else noop_mask
        self._tile_kinds: dict[tuple[int, int], Tensor] = {}

    # torch's index lists, derived on first use; read only, since the attention reads block_kinds

    def __setattr__(self, name: str, value: object) -> None:
        if name in INDEX_LISTS:
            raise AttributeError(
                f"BlockMask.{name} is derived from block_kinds, which the attention reads, so setting it would "
                "change nothing: build a new mask with BlockMask.from_kv_blocks(...) from the lists you want"
            )
        super().__setattr__(name, value)

    def _expanded(self, kind: int, *, transpose: bool = False) -> Tensor:
        """0/1 int32 table of blocks of one kind, at ``batch_shape`` (query blocks last if ``transpose``)."""
        table = (self.block_kinds == kind).to(torch.int32)
        if transpose:
            table = table.transpose(-2, -1)
        padded = (1,) * (2 - len(self.batch_shape)) + self.batch_shape
        return table.expand(*padded, *table.shape[2:]).reshape(*self.batch_shape, *table.shape[2:])

    @cached_property
    def _kv_lists(self) -> tuple[Tensor, Tensor]:
        return _ordered(self._expanded(KIND_PARTIAL))

    @cached_property
    def _full_kv_lists(self) -> tuple[Tensor, Tensor] | None:
        return _ordered(self._expanded(KIND_FULL)) if self.has_full else None

    @cached_property
    def _q_lists(self) -> tuple[Tensor, Tensor]:
        return _ordered(self._expanded(KIND_PARTIAL, transpose=True))

    @cached_property
    def _full_q_lists(self) -> tuple[Tensor, Tensor] | None:
        return _ordered(self._expanded(KIND_FULL, transpose=True)) if self.has_full else None

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
        likewise ``full_kv_*`` for FULL ones. The given tensors are kept as the mask's attributes."""
        for name, value in (
            ("dq_write_order", dq_write_order),
            ("dq_write_order_full", dq_write_order_full),
            ("dq_kv_order", dq_kv_order),
        ):
            if value is not None:
                raise AttentionValueError(
                    f"BlockMask.from_kv_blocks: {name} (deterministic dQ write order) is not supported here; "
                    f"leave {name}=None"
                )
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise AttentionValueError(
                "BlockMask.from_kv_blocks: give both full_kv_num_blocks and full_kv_indices, or neither"
            )
        if not 2 <= kv_indices.dim() <= 4 or tuple(kv_num_blocks.shape) != tuple(kv_indices.shape[:-1]):
            raise AttentionValueError(
                f"BlockMask.from_kv_blocks: kv_indices must be (*batch, T_r, T_c) with at most two batch dims and "
                f"kv_num_blocks (*batch, T_r); got kv_indices {tuple(kv_indices.shape)}, kv_num_blocks "
                f"{tuple(kv_num_blocks.shape)}"
            )
        size = block_size(BLOCK_SIZE)
        *batch, T_r, T_c = kv_indices.shape
        if seq_lengths is None:
            seq_lengths = (T_r * size[0], T_c * size[1])
        if (-(-seq_lengths[0] // size[0]), -(-seq_lengths[1] // size[1])) != (T_r, T_c):
            raise AttentionValueError(
                f"BlockMask.from_kv_blocks: seq_lengths {tuple(seq_lengths)} at BLOCK_SIZE {size} make "
                f"{-(-seq_lengths[0] // size[0])} x {-(-seq_lengths[1] // size[1])} blocks, but kv_indices has "
                f"{T_r} x {T_c}: pass the seq_lengths the lists were made for"
            )
        partial = _listed(kv_num_blocks, kv_indices)
        kinds = partial.to(torch.int8) * KIND_PARTIAL
        if full_kv_num_blocks is not None and full_kv_indices is not None:
            if tuple(full_kv_indices.shape) != tuple(kv_indices.shape):
                raise AttentionValueError(
                    f"BlockMask.from_kv_blocks: full_kv_indices {tuple(full_kv_indices.shape)} must have "
                    f"kv_indices' shape {tuple(kv_indices.shape)}"
                )
            full = _listed(full_kv_num_blocks, full_kv_indices)
            if bool((full & partial).any()):
                raise AttentionValueError(
                    "BlockMask.from_kv_blocks: a block is listed both in kv_indices and in full_kv_indices; "
                    "list each block once (FULL blocks only in full_kv_indices)"
                )
            kinds = torch.where(full, KIND_FULL, kinds).to(torch.int8)
        kinds = kinds.reshape((1,) * (2 - len(batch)) + (*batch, T_r, T_c))
        mask = cls(
            kinds, seq_lengths, size, mask_mod, batch_shape=tuple(batch), has_full=full_kv_num_blocks is not None
        )
        # the given lists are the mask's attributes (torch's); block_kinds says the same
        given: dict[str, Tensor | None] = {"kv_num_blocks": kv_num_blocks, "kv_indices": kv_indices}
        given |= {"full_kv_num_blocks": full_kv_num_blocks, "full_kv_indices": full_kv_indices}
        if not compute_q_blocks:
            given |= dict.fromkeys(("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"))
        vars(mask).update(given)
        return mask

    # torch's views of the mask

    @property
    def shape(self) -> tuple[int, ...]:
        """``(*batch_shape, N_q, N_k)``."""
        return (*self.batch_shape, *self.seq_lengths)

    def numel(self) -> int:
        return math.prod(self.shape)

    def _batch_copies(self) -> int:
        """How many (b, h) of ``batch_shape`` each (b, h) of ``block_kinds`` stands for."""
        return math.prod(self.batch_shape) // math.prod(self.block_kinds.shape[:2])

    def sparsity(self) -> float:
        """torch's figure: 100 (1 - computed / numel), computed = non-SKIP blocks x the block's area (so a
        ragged last block counts whole and the figure can go below 0)."""
        computed = int((self.block_kinds != KIND_SKIP).sum()) * self._batch_copies()
        return 100 * (1 - computed * self.BLOCK_SIZE[0] * self.BLOCK_SIZE[1] / self.numel())

    def to_dense(self) -> Tensor:
        """int32 ``(*batch_shape, T_r, T_c)``: 1 for every block computed (PARTIAL or FULL), as torch's."""
        return self._expanded(KIND_PARTIAL) | self._expanded(KIND_FULL)

    def to(self, device: torch.device | str) -> BlockMask:
        """The same mask with its kinds on ``device``."""
        return BlockMask(
            self.block_kinds.to(device),
            self.seq_lengths,
            self.BLOCK_SIZE,
            self.mask_mod,
            batch_shape=self.batch_shape,
            has_full=self.has_full,
        )

    def to_string(self, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
        """A drawing of the first ``limit`` (b, h) of ``block_kinds``, at most ``grid_size`` cells (-1: one
        cell per block): '██' every block of the cell FULL, '  ' every one SKIP, '░░' otherwise."""
        kinds = self.block_kinds.cpu()
        T_r, T_c = kinds.shape[2:]
        rows, cols = (
            (T_r, T_c) if grid_size == -1 else (grid_size, grid_size) if isinstance(grid_size, int) else grid_size
        )
        step_r, step_c = max(1, -(-T_r // rows)), max(1, -(-T_c // cols))
        pictures = []
        for n, (b, h) in enumerate(itertools.product(range(kinds.shape[0]), range(kinds.shape[1]))):
            if n == limit:
                pictures.append(f"... (to_string(limit=N) draws more; {kinds.shape[0] * kinds.shape[1]} in all)")
                break
            # a size-1 dim of the kinds stands for every batch element (head): "b=*"
            lines = [f"(b={'*' if kinds.shape[0] == 1 else b}, h={'*' if kinds.shape[1] == 1 else h})"]
            for r in range(0, T_r, step_r):
                line = ""
                for c in range(0, T_c, step_c):
                    cell = kinds[b, h, r : r + step_r, c : c + step_c]
                    line += (
                        "██" if bool((cell == KIND_FULL).all()) else "  " if bool((cell == KIND_SKIP).all()) else "░░"
                    )
                lines.append(line)
            pictures.append("\n".join(lines))
        return "\n".join(pictures)

    def __str__(self) -> str:
        return f"BlockMask(shape={self.shape}, sparsity={self.sparsity():.2f}%,\n{self.to_string()}\n)"

    def __repr__(self) -> str:
        counts = torch.bincount(self.block_kinds.flatten().to(torch.int64), minlength=3).tolist()
        name = getattr(self.mask_mod, "__name__", repr(self.mask_mod))
        return (
            f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, block_kinds="
            f"{tuple(self.block_kinds.shape)} [skip {counts[KIND_SKIP]}, partial {counts[KIND_PARTIAL]}, "
            f"full {counts[KIND_FULL]}], sparsity={self.sparsity():.2f}%, mask_mod={name})"
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


def _listed(num_blocks: Tensor, indices: Tensor) -> Tensor:
    """bool ``(*batch, T_r, T_c)``: True at the first ``num_blocks`` column indices listed per row."""
    T_c = indices.shape[-1]
    valid = torch.arange(T_c, device=indices.device) < num_blocks.unsqueeze(-1)  # (*batch, T_r, T_c)
    # an index past its row's count is written to a spare column T_c, then dropped
    target = torch.where(valid, indices.to(torch.int64), T_c)
    table = torch.zeros(*indices.shape[:-1], T_c + 1, dtype=torch.bool, device=indices.device)
    return table.scatter(-1, target, True)[..., :T_c]


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
