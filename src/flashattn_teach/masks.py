"""The mask contract: which keys a query row sees, and what is added to its scores.

For query row ``i`` and key column ``j`` of batch element ``b`` and query head ``h``, with ``off`` the
diagonal offset of ``causal_align`` (0 for ``top_left``, ``N_k - N_q`` for ``bottom_right``; see
:mod:`flashattn_teach.causal`), the score is built in flash-attn's order (its kernels scale, then cap,
then mask and add the ALiBi bias; its test reference does the same)::

    S_ij  = scale * q_i . k_j
    S_ij  = softcap * tanh(S_ij / softcap)        softcap: before any bias or mask
    S_ij += -slope[b, h] * |i + off - j|          alibi_slopes, flash-attn's definition
    S_ij += attn_mask[b, h, i, j]                 an additive (float) attn_mask
    S_ij  = -inf unless visible(b, h, i, j)

    visible(b, h, i, j) =  i + off - left <= j <= i + off + right    window (left, right); -1: unbounded
                       and j < seqlens_k[b]                          keys past a batch element's length
                       and attn_mask[b, h, i, j]                     a bool attn_mask (True: visible)

``causal=True`` is the window's right side 0: ``window=(-1, 0)`` with ``causal=False`` is causal masking.
A window is allowed without ``causal``; with it, ``right`` is 0 whatever was given. ``off`` comes from
``N_q`` and ``N_k``, not from ``seqlens_k[b]``. A row that sees no key gives ``O = 0`` and
``lse = -inf``. Two shapes of window, ``N_q = N_k = 6``, ``top_left`` (x: visible)::

    window=(2, 0)            window=(1, 1)
      keys 0 1 2 3 4 5         keys 0 1 2 3 4 5
    q 0    x . . . . .       q 0    x x . . . .
    q 1    x x . . . .       q 1    x x x . . .
    q 2    x x x . . .       q 2    . x x x . .
    q 3    . x x x . .       q 3    . . x x x .
    q 4    . . x x x .       q 4    . . . x x x
    q 5    . . . x x x       q 5    . . . . x x

Tiles, not elements: each (query block ``i``, key block ``j``) tile is SKIP (no key visible to any row: never
visited), FULL (every key visible to every row: no per-element mask work; an ALiBi or additive bias is
still added) or PARTIAL (the tile's own mask is built). For the window, the causal diagonal and
``seqlens_k`` the kind is arithmetic on the block bounds. For an ``attn_mask`` it comes from a per-tile
summary (FlexAttention's block mask) built once per call and tiling, in one pass over the user's mask,
which holds ``O(T_r x T_c)`` flags and nothing ``N_q x N_k``. Masks and biases are then built one tile at a
time, in the score layout ``(*batch, H_q, Br, Bc)`` with size-1 dims where they broadcast, or in the
grouped layout of ``_layout.py``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor

from ._layout import compute_dtype
from ._validate import AttentionShapes
from .causal import TileKind, diagonal_offset

NEG_INF = float("-inf")


def _blocks(N: int, size: int) -> list[tuple[int, int]]:
    """``[(0, size), (size, 2 size), ..., (., N)]``: the bounds of each block; the last may be short."""
    return [(start, min(start + size, N)) for start in range(0, N, size)]


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
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


@dataclass(frozen=True)
class MaskSpec:
    """Everything that decides a call's visibility and score bias; built once per call by ``make_options``.

    ``causal`` is the user's flag; ``left, right`` are the window with causal folded in (``-1``:
    unbounded); ``seqlens_k`` has the batch shape; ``attn_mask`` is the user's mask with leading 1s up to
    the score rank (a view, no copy).
    """

    shapes: AttentionShapes
    offset: int
    causal: bool = False
    left: int = -1
    right: int = -1
    softcap: float | None = None
    alibi_slopes: Tensor | None = None
    seqlens_k: Tensor | None = None
    attn_mask: Tensor | None = None
    dtype: torch.dtype = torch.float32  # the compute dtype biases are built in
    _tilings: dict[tuple[int, int], Tiling] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def build(
        shapes: AttentionShapes,
        q_dtype: torch.dtype,
        *,
        causal: bool,
        causal_align: str,
        window: tuple[int, int] = (-1, -1),
        softcap: float | None = None,
        alibi_slopes: Tensor | None = None,
        seqlens_k: Tensor | None = None,
        attn_mask: Tensor | None = None,
    ) -> MaskSpec:
        left, right = window
        if attn_mask is not None:
            rank = len(shapes.score_shape)
            attn_mask = attn_mask.reshape((1,) * (rank - attn_mask.dim()) + tuple(attn_mask.shape))
        return MaskSpec(
            shapes=shapes,
            offset=diagonal_offset(shapes.N_q, shapes.N_k, causal_align),
            causal=causal,
            left=left,
            right=0 if causal else right,  # causal is the window's right side 0, intersected with any window
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            seqlens_k=seqlens_k,
            attn_mask=attn_mask,
            dtype=compute_dtype(q_dtype),
        )

    # ------------------------------------------------------------------------------------- what is set

    @property
    def variants(self) -> tuple[str, ...]:
        """The options beyond plain (causal) attention that this call uses, by argument name."""
        # A window whose right side is folded into causal, and no left side, is plain causal masking.
        named = {
            "window": self.left >= 0 or (self.right >= 0 and not self.causal),
            "softcap": self.softcap is not None,
            "alibi_slopes": self.alibi_slopes is not None,
            "seqlens_k": self.seqlens_k is not None,
            "attn_mask": self.attn_mask is not None,
        }
        return tuple(name for name, used in named.items() if used)

    @property
    def seqlen_bounds(self) -> tuple[int, int]:
        """``(min, max)`` of ``seqlens_k`` over the batch (``(N_k, N_k)`` without it)."""
        N_k = self.shapes.N_k
        if self.seqlens_k is None or self.seqlens_k.numel() == 0:
            return N_k, N_k
        return int(self.seqlens_k.min()), int(self.seqlens_k.max())

    # ----------------------------------------------------------------- the window, causal and seqlens_k

    def key_range(self, r0: int, r1: int) -> tuple[int, int]:
        """``[c_lo, c_hi)``: the key columns any of the rows ``[r0, r1)`` may see (before ``attn_mask``).

        Row i sees ``i + off - left <= j <= i + off + right``; the bounds grow with i.
        """
        N_k = self.shapes.N_k
        lo = 0 if self.left < 0 else max(0, r0 + self.offset - self.left)
        hi = N_k if self.right < 0 else min(N_k, (r1 - 1) + self.offset + self.right + 1)
        hi = min(hi, self.seqlen_bounds[1])
        return lo, max(lo, hi)

    def query_range(self, c0: int, c1: int) -> tuple[int, int]:
        """``[r_lo, r_hi)``: the query rows that may see some key of ``[c0, c1)`` (before ``attn_mask``).

        Key j is seen by rows ``j - off - right <= i <= j - off + left``.
        """
        N_q = self.shapes.N_q
        if c0 >= self.seqlen_bounds[1]:
            return 0, 0
        lo = 0 if self.right < 0 else max(0, c0 - self.offset - self.right)
        hi = N_q if self.left < 0 else min(N_q, (c1 - 1) - self.offset + self.left + 1)
        return lo, max(lo, hi)

    def structure_kind(self, r0: int, r1: int, c0: int, c1: int, *, b: int | None = None) -> TileKind:
        """The tile's kind under the window, causal and ``seqlens_k`` (of batch element ``b``, flat index;
        None: over the whole batch, SKIP only if SKIP for every element, FULL only if FULL for every one)."""
        lo, hi = self.key_range(r0, r1)
        if self.seqlens_k is not None and b is not None:
            length = self._lengths[b]
            shortest = longest = length
        else:
            shortest, longest = self.seqlen_bounds
        if c1 <= lo or c0 >= hi or c0 >= longest:
            return TileKind.SKIP
        # Rows that see some key of the tile form one range (both window bounds grow with i) ...
        q_lo, q_hi = self.query_range(c0, c1)
        if max(q_lo, r0) >= min(q_hi, r1):
            return TileKind.SKIP
        # ... and every row sees every key when the last row's lower bound and the first row's upper bound
        # enclose the tile.
        full_left = self.left < 0 or (r1 - 1) + self.offset - self.left <= c0
        full_right = self.right < 0 or r0 + self.offset + self.right >= c1 - 1
        return TileKind.FULL if full_left and full_right and c1 <= shortest else TileKind.PARTIAL

    # ---------------------------------------------------------------------------- tensors of one tile

    def _rank(self) -> int:
        return len(self.shapes.score_shape)

    def structure_visible(
        self, r0: int, r1: int, c0: int, c1: int, device: torch.device, *, b: int | None = None
    ) -> Tensor:
        """Bool, broadcastable to the score tile ``(*batch, H_q, Br, Bc)``: window, causal, ``seqlens_k``;
        ``(Br, Bc)`` for batch element ``b`` alone."""
        rows = torch.arange(r0, r1, device=device)[:, None]  # (Br, 1)
        cols = torch.arange(c0, c1, device=device)[None, :]  # (1, Bc)
        vis = torch.ones(r1 - r0, c1 - c0, dtype=torch.bool, device=device)  # (Br, Bc)
        if self.left >= 0:
            vis &= cols >= rows + self.offset - self.left
        if self.right >= 0:
            vis &= cols <= rows + self.offset + self.right
        if self.seqlens_k is not None and b is not None:
            vis &= cols < self._lengths[b]
        elif self.seqlens_k is not None:
            lengths = self.seqlens_k.reshape(*self.shapes.batch, *(1,) * (self._rank() - len(self.shapes.batch)))
            vis = vis & (cols < lengths)  # (*batch, 1, 1, Bc) for rank >= 3, (1, Bc) for rank 2
        return vis

    def alibi_bias(
        self, r0: int, r1: int, c0: int, c1: int, device: torch.device, *, b: int | None = None, h: int = 0
    ) -> Tensor | None:
        """``-slope[b, h] * |i + off - j|`` over the tile, broadcastable to the score tile (``(Br, Bc)`` for
        batch element ``b`` and head ``h``); None without ALiBi."""
        if self.alibi_slopes is None:
            return None
        rows = torch.arange(r0, r1, device=device, dtype=self.dtype)[:, None]  # (Br, 1)
        cols = torch.arange(c0, c1, device=device, dtype=self.dtype)[None, :]  # (1, Bc)
        distance = (rows + self.offset - cols).abs()  # (Br, Bc)
        if b is not None or self._rank() == 2:  # one head, or 2-D inputs with their one slope
            slopes = self.alibi_slopes.reshape(-1, self.shapes.H_q)  # (1 or B, H_q)
            slope = slopes[b if b is not None and slopes.shape[0] > 1 else 0, h].to(self.dtype)
            return -slope * distance  # (Br, Bc)
        slopes = self.alibi_slopes.to(self.dtype).reshape(*self.alibi_slopes.shape, 1, 1)
        return -slopes * distance  # (*batch, H_q, Br, Bc) or (H_q, Br, Bc)

    def mask_tile(self, r0: int, r1: int, c0: int, c1: int, *, b: int | None = None, h: int = 0) -> Tensor:
        """The user's ``attn_mask`` over the tile (a view), broadcastable to the score tile, or of batch
        element ``b`` (flat index) and query head ``h`` alone."""
        assert self.attn_mask is not None
        m = self.attn_mask
        if b is not None and m.dim() > 2:
            index = (*_unravel(b, self.shapes.batch), h)
            m = m[tuple(x if n > 1 else 0 for x, n in zip(index, m.shape[:-2], strict=True))]  # 2-D
        rows = slice(r0, r1) if m.shape[-2] > 1 else slice(None)
        cols = slice(c0, c1) if m.shape[-1] > 1 else slice(None)
        return m[..., rows, cols]

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
        b: int | None = None,
        h: int = 0,
    ) -> tuple[Tensor | None, Tensor | None]:
        """``(visible, bias)`` of one tile, broadcastable to its scores (or for batch element ``b`` and head
        ``h`` alone), built only where the kinds need it: the structure's mask for a PARTIAL structure, the
        user's bool mask for a PARTIAL mask tile. An additive mask and ALiBi always add their bias (None
        when neither is set)."""
        visible = self.structure_visible(r0, r1, c0, c1, device, b=b) if structure is TileKind.PARTIAL else None
        bias = self.alibi_bias(r0, r1, c0, c1, device, b=b, h=h)
        if self.attn_mask is not None and mask is not TileKind.FULL:
            m = self.mask_tile(r0, r1, c0, c1, b=b, h=h)
            if m.dtype == torch.bool:
                visible = m if visible is None else visible & m
            else:
                bias = m.to(self.dtype) if bias is None else bias + m.to(self.dtype)
        return visible, bias

    @cached_property
    def _lengths(self) -> list[int]:
        """``seqlens_k`` by flat batch index, as Python ints (read once per call, not once per tile)."""
        return [] if self.seqlens_k is None else self.seqlens_k.reshape(-1).tolist()

    def dense(self, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
        """``(visible, bias)`` over all ``N_q x N_k`` scores: the dense oracle's masks."""
        N_q, N_k = self.shapes.N_q, self.shapes.N_k
        whole = self.structure_kind(0, N_q, 0, N_k) if N_q and N_k else TileKind.FULL
        structure = TileKind.FULL if whole is TileKind.FULL else TileKind.PARTIAL  # a SKIP matrix is all False
        return self.tensors(0, N_q, 0, N_k, device, structure=structure, mask=TileKind.PARTIAL)

    # ------------------------------------------------------------------------------------------ tilings

    def tiling(self, block_m: int, block_n: int) -> Tiling:
        """The per-tile plan for ``block_m x block_n`` tiles; built once per spec and tiling."""
        key = (block_m, block_n)
        if key not in self._tilings:
            self._tilings[key] = Tiling(self, block_m, block_n)
        return self._tilings[key]


class MaskSummary:
    """FlexAttention's block mask for a user ``attn_mask``: per (query block, key block) whether some
    entry is visible (``some``) and whether every entry is visible with nothing added (``free``).

    A bool mask's entry is visible where True and free where True; an additive mask's entry is visible
    where it is not ``-inf`` and free where it is 0. One pass over the mask, one key block at a time
    (``O(mask size)`` work, ``O(N_q x T_c)`` extra memory), then one pass over the query blocks.
    Broadcast dims stay size 1: a mask of shape ``(1, 1, 1, N_k)`` gives flags of shape ``(1, 1, 1, T_c)``.
    """

    def __init__(self, mask: Tensor, block_m: int, block_n: int) -> None:
        row_blocks = _blocks(mask.shape[-2], block_m) if mask.shape[-2] > 1 else [(0, 1)]
        col_blocks = _blocks(mask.shape[-1], block_n) if mask.shape[-1] > 1 else [(0, 1)]
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


class Tiling:
    """One call's tiles at ``block_m x block_n``: their kinds, which to visit, and their masks.

    Kinds here are over the whole batch and every head (the CPU references run all of them at once):
    a tile is visited if any batch element or head sees part of it.
    """

    def __init__(self, spec: MaskSpec, block_m: int, block_n: int) -> None:
        self.spec = spec
        self.row_blocks = _blocks(spec.shapes.N_q, block_m)
        self.col_blocks = _blocks(spec.shapes.N_k, block_n)
        self.block_m, self.block_n = block_m, block_n
        self.summary = None if spec.attn_mask is None else MaskSummary(spec.attn_mask, block_m, block_n)

    def _kinds(self, i: int, j: int) -> tuple[TileKind, TileKind]:
        (r0, r1), (c0, c1) = self.row_blocks[i], self.col_blocks[j]
        structure = self.spec.structure_kind(r0, r1, c0, c1)
        mask = TileKind.FULL if self.summary is None else self.summary.kind(i, j)
        return structure, mask

    def kind(self, i: int, j: int, *, b: int | None = None, h: int | None = None) -> TileKind:
        """The kind of tile ``(i, j)``: over the whole batch and every head, or for batch element ``b``
        (a flat index into the batch dims) and query head ``h`` (both needed for an ``attn_mask``)."""
        if b is None:
            return _combine(*self._kinds(i, j))
        (r0, r1), (c0, c1) = self.row_blocks[i], self.col_blocks[j]
        structure = self.spec.structure_kind(r0, r1, c0, c1, b=b)
        mask = TileKind.FULL
        if self.summary is not None:
            if h is None:
                raise ValueError("a tile's kind under an attn_mask depends on the head: pass h")
            mask = self.summary.kind(i, j, self._index(b, h))
        return _combine(structure, mask)

    def key_blocks(self, i: int, *, b: int | None = None, h: int | None = None) -> list[int]:
        """The key blocks query block ``i`` visits, in order: every one whose tile is not SKIP (over the
        whole batch, or for batch element ``b`` and head ``h``)."""
        r0, r1 = self.row_blocks[i]
        lo, hi = self.spec.key_range(r0, r1)
        near = range(lo // self.block_n, math.ceil(hi / self.block_n)) if hi > lo else range(0)
        return [j for j in near if self.kind(i, j, b=b, h=h) is not TileKind.SKIP]

    def query_blocks(self, j: int, *, b: int | None = None, h: int | None = None) -> list[int]:
        """The query blocks that visit key block ``j``, in order (the key-major loops' inner range)."""
        c0, c1 = self.col_blocks[j]
        lo, hi = self.spec.query_range(c0, c1)
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
        return self.spec.tensors(r0, r1, c0, c1, device, structure=structure, mask=mask, b=b, h=h)

    def _index(self, b: int, h: int) -> tuple[int, ...]:
        """The ``(*batch, h)`` index into the mask summary's leading dims for flat batch ``b``, head ``h``
        (none for 2-D inputs, whose scores have no batch or head dims)."""
        assert self.summary is not None
        return (*_unravel(b, self.spec.shapes.batch), h) if self.summary.some.dim() > 2 else ()

    def tile(self, i: int, j: int, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
        """``(visible, bias)`` of tile ``(i, j)`` in the grouped layout ``(B|1, H_kv|1, G|1, Br, Bc)``."""
        (r0, r1), (c0, c1) = self.row_blocks[i], self.col_blocks[j]
        structure, mask = self._kinds(i, j)
        visible, bias = self.spec.tensors(r0, r1, c0, c1, device, structure=structure, mask=mask)
        return (None if visible is None else self.grouped(visible)), (None if bias is None else self.grouped(bias))

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
