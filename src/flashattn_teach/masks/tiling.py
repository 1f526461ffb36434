"""One call's tiles: the per-tile plan the CPU loops follow, and the block summary of a user ``attn_mask``.

:class:`Tiling` cuts a call into ``block_m x block_n`` tiles (query block ``i``, key block ``j``) and asks
the mask contract (:class:`~flashattn_teach.masks.MaskSpec`) for each tile's kind: SKIP tiles are never
visited, FULL ones run without a mask, PARTIAL ones with the tile's own. The loops over blocks start and end
at the contract's key and query ranges, so a query block scans only the key blocks near its band (or its
packed sequences), not all ``T_c`` of them. :class:`MaskSummary` is FlexAttention's block mask for an
``attn_mask``, built once per call and tiling.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import torch
from torch import Tensor

from .._validate.inputs import AttentionShapes
from ..flex.mods import KIND_FULL, KIND_SKIP, CaptureGrads, TileIndex, UserMods, score_backward
from .causal import TileKind


class MaskContract(Protocol):
    """What a tiling reads of the mask contract (:class:`flashattn_teach.masks.MaskSpec` is the one
    implementation; the tiling never imports it, so the two modules do not import each other)."""

    shapes: AttentionShapes
    attn_mask: Tensor | None
    mods: UserMods | None

    def key_range(self, r0: int, r1: int, *, b: int | None = None) -> tuple[int, int]: ...

    def tile_index(
        self, r0: int, r1: int, c0: int, c1: int, device: torch.device, *, b: int | None = None, h: int = 0
    ) -> TileIndex: ...

    def query_range(self, c0: int, c1: int, *, b: int | None = None) -> tuple[int, int]: ...

    def structure_kind(self, r0: int, r1: int, c0: int, c1: int, *, b: int | None = None) -> TileKind: ...

    def tensors(
        self,
        r0: int,
        r1: int,
        c0: int,
        c1: int,
        device: torch.device,
        *,
        structure: TileKind,
        mask: TileKind,
        user: TileKind = TileKind.FULL,
        b: int | None = None,
        h: int = 0,
    ) -> tuple[Tensor | None, Tensor | None]: ...


Contract = TypeVar("Contract", bound=MaskContract)

NEG_INF = float("-inf")


def blocks(N: int, size: int) -> list[tuple[int, int]]:
    """``[(0, size), (size, 2 size), ..., (., N)]``: the bounds of each block; the last may be short."""
    return [(start, min(start + size, N)) for start in range(0, N, size)]


def unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The multi-index of ``flat`` in row-major ``shape``."""
    index = []
    for n in reversed(shape):
        index.append(flat % n)
        flat //= n
    return tuple(reversed(index))


def _combine(a: TileKind, b: TileKind) -> TileKind:
    """The kind of a tile under two masks at once (visible = visible under both)."""
    if TileKind.SKIP in (a, b):
        return TileKind.SKIP
    return TileKind.FULL if a is b is TileKind.FULL else TileKind.PARTIAL


class MaskSummary:
    """FlexAttention's block mask for a user ``attn_mask``: per (query block, key block) whether some
    entry is visible (``some``) and whether every entry is visible with nothing added (``free``).

    A bool mask's entry is visible where True and free where True; an additive mask's entry is visible
    where it is not ``-inf`` and free where it is 0. One pass over the mask, one key block at a time
    (``O(mask size)`` work, ``O(N_q x T_c)`` extra memory), then one pass over the query blocks.
    Broadcast dims stay size 1: a mask of shape ``(1, 1, 1, N_k)`` gives flags of shape ``(1, 1, 1, T_c)``.
    """

    def __init__(self, mask: Tensor, block_m: int, block_n: int) -> None:
        row_blocks = blocks(mask.shape[-2], block_m) if mask.shape[-2] > 1 else [(0, 1)]
        col_blocks = blocks(mask.shape[-1], block_n) if mask.shape[-1] > 1 else [(0, 1)]
        some_cols, free_cols = [], []
        for c0, c1 in col_blocks:  # key block j: reduce its columns, (..., N_q', Bc) -> (..., N_q')
            m = mask[..., c0:c1]
            seen, free = (m, m) if m.dtype == torch.bool else (m != NEG_INF, m == 0)
            some_cols.append(seen.any(dim=-1))
            free_cols.append(free.all(dim=-1))
        some_rc = torch.stack(some_cols, dim=-1)  # (..., N_q', T_c')
        free_rc = torch.stack(free_cols, dim=-1)
        # query block i: reduce its rows, (..., N_q', T_c') -> (..., T_r', T_c')
        self.some = torch.stack([some_rc[..., r0:r1, :].any(dim=-2) for r0, r1 in row_blocks], dim=-2)
        self.free = torch.stack([free_rc[..., r0:r1, :].all(dim=-2) for r0, r1 in row_blocks], dim=-2)
        lead = tuple(range(self.some.dim() - 2))
        # Over the whole batch and every head: SKIP only if no element sees anything of the tile.
        self.some_anywhere: list[list[bool]] = self.some.any(dim=lead).tolist() if lead else self.some.tolist()
        self.free_everywhere: list[list[bool]] = self.free.all(dim=lead).tolist() if lead else self.free.tolist()

    def kind(self, i: int, j: int, index: tuple[int, ...] | None = None) -> TileKind:
        """The tile's kind under the mask, anywhere (``index`` None) or at one ``(*batch, h)`` index."""
        i = min(i, self.some.shape[-2] - 1)  # a broadcast row or column dim has one block
        j = min(j, self.some.shape[-1] - 1)
        if index is None:
            some, free = self.some_anywhere[i][j], self.free_everywhere[i][j]
        else:
            at = tuple(x if n > 1 else 0 for x, n in zip(index, self.some.shape[:-2], strict=True))
            where = (*at, i, j)
            some, free = bool(self.some[where]), bool(self.free[where])
        if not some:
            return TileKind.SKIP
        return TileKind.FULL if free else TileKind.PARTIAL


class UserKinds:
    """The kinds of a call's tiles under its block mask and ``mask_mod`` (:mod:`flashattn_teach.flex.mods`):
    the block mask's own table re-tiled to these tiles (``BlockMask.tile_kinds``, conservative: SKIP only
    if every block the tile meets is SKIP, FULL only if every one is FULL), or every tile PARTIAL when a
    ``mask_mod`` comes without a block mask."""

    def __init__(self, mods: UserMods, block_m: int, block_n: int) -> None:
        bm = mods.block_mask
        self.table = None if bm is None else bm.tile_kinds(block_m, block_n)  # (B|1, H|1, T_r, T_c) int8
        if self.table is not None:
            self.skip_everywhere: list[list[bool]] = (self.table == KIND_SKIP).all(dim=1).all(dim=0).tolist()
            self.full_everywhere: list[list[bool]] = (self.table == KIND_FULL).all(dim=1).all(dim=0).tolist()

    def kind(self, i: int, j: int, b: int | None = None, h: int | None = None) -> TileKind:
        """The tile's kind anywhere (``b`` None) or for flat batch element ``b`` and query head ``h``."""
        if self.table is None:
            return TileKind.PARTIAL
        if b is None:
            skip, full = self.skip_everywhere[i][j], self.full_everywhere[i][j]
        else:
            Bm, Hm = self.table.shape[:2]
            code = int(self.table[b if Bm > 1 else 0, (h or 0) if Hm > 1 else 0, i, j])
            skip, full = code == KIND_SKIP, code == KIND_FULL
        return TileKind.SKIP if skip else TileKind.FULL if full else TileKind.PARTIAL


class Tiling(Generic[Contract]):
    """One call's tiles at ``block_m x block_n``: their kinds, which to visit, and their masks.

    Kinds here are over the whole batch and every head (the CPU references run all of them at once):
    a tile is visited if any batch element or head sees part of it.
    """

    def __init__(self, spec: Contract, block_m: int, block_n: int) -> None:
        self.spec = spec
        self.row_blocks = blocks(spec.shapes.N_q, block_m)
        self.col_blocks = blocks(spec.shapes.N_k, block_n)
        self.block_m, self.block_n = block_m, block_n
        self.summary = None if spec.attn_mask is None else MaskSummary(spec.attn_mask, block_m, block_n)
        mods = spec.mods
        self.user = None if mods is None or "mask_mod" not in mods.names else UserKinds(mods, block_m, block_n)
        # batch-wide structure kinds, asked for again by every loop (over each element's geometry: O(B) each)
        self._structure: dict[tuple[int, int], TileKind] = {}

    def _kinds(self, i: int, j: int) -> tuple[TileKind, TileKind, TileKind]:
        if (i, j) not in self._structure:
            (r0, r1), (c0, c1) = self.row_blocks[i], self.col_blocks[j]
            self._structure[i, j] = self.spec.structure_kind(r0, r1, c0, c1)
        structure = self._structure[i, j]
        mask = TileKind.FULL if self.summary is None else self.summary.kind(i, j)
        user = TileKind.FULL if self.user is None else self.user.kind(i, j)
        return structure, mask, user

    def kind(self, i: int, j: int, *, b: int | None = None, h: int | None = None) -> TileKind:
        """The kind of tile ``(i, j)``: over the whole batch and every head, or for batch element ``b``
        (a flat index into the batch dims) and query head ``h`` (both needed for an ``attn_mask``)."""
        if b is None:
            structure, mask, user = self._kinds(i, j)
            return _combine(_combine(structure, mask), user)
        (r0, r1), (c0, c1) = self.row_blocks[i], self.col_blocks[j]
        structure = self.spec.structure_kind(r0, r1, c0, c1, b=b)
        mask = TileKind.FULL
        if self.summary is not None:
            if h is None:
                raise ValueError("a tile's kind under an attn_mask depends on the head: pass h")
            mask = self.summary.kind(i, j, self._index(b, h))
        user = TileKind.FULL if self.user is None else self.user.kind(i, j, b, h)
        return _combine(_combine(structure, mask), user)

    def key_blocks(self, i: int, *, b: int | None = None, h: int | None = None) -> list[int]:
        """The key blocks query block ``i`` visits, in order: every one whose tile is not SKIP (over the
        whole batch, or for batch element ``b`` and head ``h``)."""
        r0, r1 = self.row_blocks[i]
        lo, hi = self.spec.key_range(r0, r1, b=b)
        near = range(lo // self.block_n, math.ceil(hi / self.block_n)) if hi > lo else range(0)
        return [j for j in near if self.kind(i, j, b=b, h=h) is not TileKind.SKIP]

    def query_blocks(self, j: int, *, b: int | None = None, h: int | None = None) -> list[int]:
        """The query blocks that visit key block ``j``, in order (the key-major loops' inner range)."""
        c0, c1 = self.col_blocks[j]
        lo, hi = self.spec.query_range(c0, c1, b=b)
        near = range(lo // self.block_m, math.ceil(hi / self.block_m)) if hi > lo else range(0)
        return [i for i in near if self.kind(i, j, b=b, h=h) is not TileKind.SKIP]

    def head_tile(
        self, i: int, j: int, rows: tuple[int, int], *, b: int, h: int, device: torch.device
    ) -> tuple[Tensor | None, Tensor | None]:
        """``(visible, bias)`` of tile ``(i, j)`` of batch element ``b`` and head ``h``, for the query rows
        ``rows = (r0, r1)`` within block ``i`` (a loop may leave out rows that see nothing of the tile)."""
        r0, r1 = rows
        c0, c1 = self.col_blocks[j]
        structure = self.spec.structure_kind(r0, r1, c0, c1, b=b)
        mask = TileKind.FULL if self.summary is None else self.summary.kind(i, j, self._index(b, h))
        user = TileKind.FULL if self.user is None else self.user.kind(i, j, b, h)
        return self.spec.tensors(r0, r1, c0, c1, device, structure=structure, mask=mask, user=user, b=b, h=h)

    def _index(self, b: int, h: int) -> tuple[int, ...]:
        """The ``(*batch, h)`` index into the mask summary's leading dims for flat batch ``b``, head ``h``
        (none for 2-D inputs, whose scores have no batch or head dims)."""
        assert self.summary is not None
        return (*unravel(b, self.spec.shapes.batch), h) if self.summary.some.dim() > 2 else ()

    def tile(self, i: int, j: int, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
        """``(visible, bias)`` of tile ``(i, j)`` in the grouped layout ``(B|1, H_kv|1, G|1, Br, Bc)``."""
        (r0, r1), (c0, c1) = self.row_blocks[i], self.col_blocks[j]
        structure, mask, user = self._kinds(i, j)
        visible, bias = self.spec.tensors(r0, r1, c0, c1, device, structure=structure, mask=mask, user=user)
        return (None if visible is None else self.grouped(visible)), (None if bias is None else self.grouped(bias))

    def score_mod(
        self,
        i: int,
        j: int,
        device: torch.device,
        rows: tuple[int, int] | None = None,
        *,
        b: int | None = None,
        h: int = 0,
    ) -> Callable[[Tensor], Tensor] | None:
        """``S -> score_mod(S, ...)`` for tile ``(i, j)`` (its query rows ``rows``, default the block's), on a
        grouped-layout tile ``(B, H_kv, G, Br, Bc)``, or on ``(Br, Bc)`` of batch element ``b`` and head
        ``h``; None without a ``score_mod``."""
        mods = self.spec.mods
        if mods is None or mods.score_mod is None:
            return None
        (r0, r1), (c0, c1) = rows or self.row_blocks[i], self.col_blocks[j]
        index = self.spec.tile_index(r0, r1, c0, c1, device, b=b, h=h)
        if b is not None:
            return functools.partial(mods.score, index=index)

        def grouped(S: Tensor) -> Tensor:  # (B, H_kv, G, Br, Bc) -> flat (B, H_q, Br, Bc) and back
            return mods.score(S.reshape(S.shape[0], -1, *S.shape[-2:]), index).reshape(S.shape)

        return grouped

    def score_backward(
        self,
        i: int,
        j: int,
        S: Tensor,
        grads: CaptureGrads | None,
        rows: tuple[int, int] | None = None,
        *,
        b: int | None = None,
        h: int = 0,
    ) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
        """``(score_mod(S), dS_out -> dS_in)`` of tile ``(i, j)`` (layouts as :meth:`score_mod`); the vjp adds
        the captured tensors' gradients to ``grads``. The scores returned are the caller's to mask in place."""
        mods = self.spec.mods
        assert mods is not None and mods.score_mod is not None
        (r0, r1), (c0, c1) = rows or self.row_blocks[i], self.col_blocks[j]
        index = self.spec.tile_index(r0, r1, c0, c1, S.device, b=b, h=h)
        flat = S if b is not None else S.reshape(S.shape[0], -1, *S.shape[-2:])
        out, vjp = score_backward(mods, flat, index, grads)
        if b is not None:
            return out, vjp
        return out.reshape(S.shape), lambda dS: vjp(dS.reshape(flat.shape)).reshape(S.shape)

    def grouped(self, t: Tensor) -> Tensor:
        """A tensor broadcastable to the score tile ``(*batch, H_q, Br, Bc)`` -> the grouped layout, keeping
        size-1 batch and head dims (no copy unless some batch dims broadcast and others do not)."""
        s = self.spec.shapes
        rank = len(s.score_shape)
        if rank == 2:
            return t.reshape(1, 1, 1, *t.shape[-2:])
        t = t.reshape((1,) * (rank - t.dim()) + tuple(t.shape))
        lead, h, tile = t.shape[:-3], t.shape[-3], t.shape[-2:]
        batch = lead if all(n == 1 for n in lead) else s.batch
        B = math.prod(batch)
        heads = (1, 1) if h == 1 else (s.H_kv, s.group)
        return t.expand(*batch, h, *tile).reshape(B, *heads, *tile)

    def counts(self) -> Counter[TileKind]:
        """How many tiles of each kind the call has (over the whole batch and every head)."""
        return Counter(self.kind(i, j) for i in range(len(self.row_blocks)) for j in range(len(self.col_blocks)))
