"""The mask contract: which keys a query row sees, and what is added to its scores.

For query row ``i`` and key column ``j`` of batch element ``b`` and query head ``h``, with ``off`` the
diagonal offset of ``causal_align`` (0 for ``top_left``; ``N_k - N_q`` for ``bottom_right``, and with
``seqlens_k`` each element's own ``seqlens_k[b] - N_q``; see :mod:`flashattn_teach.masks.causal`), the score is
built in flash-attn's order (its kernels scale, then cap, then mask and add the ALiBi bias; its test
reference does the same)::

    S_ij  = scale * q_i . k_j
    S_ij  = softcap * tanh(S_ij / softcap)        softcap: before any bias or mask
    S_ij += -slope[b, h] * |i + off - j|          alibi_slopes, flash-attn's definition
    S_ij += attn_mask[b, h, i, j]                 an additive (float) attn_mask
    S_ij  = -inf unless visible(b, h, i, j)

    visible(b, h, i, j) =  i + off - left <= j <= i + off + right    window (left, right); -1: unbounded
                       and j < seqlens_k[b]                          keys past a batch element's length
                       and seq_q(i) == seq_k(j)                      packed sequences (cu_seqlens; packed.py)
                       and attn_mask[b, h, i, j]                     a bool attn_mask (True: visible)

``causal=True`` is the window's right side 0: ``window=(-1, 0)`` with ``causal=False`` is causal masking.
A window is allowed without ``causal``; with it, ``right`` is 0 whatever was given. Under ``bottom_right``
with ``seqlens_k`` the offset is each batch element's own, ``off_b = seqlens_k[b] - N_q``: the last query
row sits at the element's last key, as in flash-attn's varlen and KV-cache calls (``top_left`` keeps
``off = 0`` for every element; the decode path passes its own ``offset`` per batch element and key range,
:mod:`flashattn_teach.serving.api`). A row that sees no key gives ``O = 0`` and ``lse = -inf``. Two shapes of window,
``N_q = N_k = 6``, ``top_left`` (x: visible)::

    window=(2, 0)            window=(1, 1)
      keys 0 1 2 3 4 5         keys 0 1 2 3 4 5
    q 0    x . . . . .       q 0    x x . . . .
    q 1    x x . . . .       q 1    x x x . . .
    q 2    x x x . . .       q 2    . x x x . .
    q 3    . x x x . .       q 3    . . x x x .
    q 4    . . x x x .       q 4    . . . x x x
    q 5    . . . x x x       q 5    . . . . x x

With packed sequences (``cu_seqlens_q``, ``cu_seqlens_k``) ``i`` and ``j`` run over the packed axis, each
sequence sees only itself, and the window, the causal offset and the ALiBi distance are those of the
sequence (``packed.py``).

Tiles, not elements: each (query block ``i``, key block ``j``) tile is SKIP (no key visible to any row: never
visited), FULL (every key visible to every row: no per-element mask work; an ALiBi or additive bias is
still added) or PARTIAL (the tile's own mask is built). For the window, the causal diagonal and
``seqlens_k`` the kind is arithmetic on the block bounds (``window.py``; per sequence for packed ones).
For an ``attn_mask`` it comes from a per-tile summary (FlexAttention's block mask) built once per call and
tiling, in one pass over the user's mask, which holds ``O(T_r x T_c)`` flags and nothing ``N_q x N_k``.
Masks and biases are then built one tile at a time, in the score layout ``(*batch, H_q, Br, Bc)`` with
size-1 dims where they broadcast, or in the grouped layout of ``_layout.py``. The per-call tile plan,
:class:`Tiling`, and the ``attn_mask`` block summary, :class:`MaskSummary`, live in ``tiling.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor

from .._layout import compute_dtype
from .._validate.inputs import AttentionShapes
from ..flex.mods import TileIndex, UserMods, to_flat
from .causal import TileKind, diagonal_offset
from .packed import PackedSequences
from .tiling import MaskSummary, Tiling, unravel
from .window import band_keys, band_kind, band_rows

__all__ = ["MaskSpec", "MaskSummary", "Tiling"]


@dataclass(frozen=True)
class MaskSpec:
    """Everything that decides a call's visibility and score bias; built once per call by ``make_options``.

    ``causal`` is the user's flag; ``left, right`` are the window with causal folded in (``-1``:
    unbounded); ``seqlens_k`` has the batch shape; ``attn_mask`` is the user's mask with leading 1s up to
    the score rank (a view, no copy); ``packed`` the sequence bounds of a packed call (``offset`` is then
    unused: each sequence has its own). ``offset`` is the diagonal offset of ``N_q`` and ``N_k``; with
    ``per_element`` (``bottom_right`` and ``seqlens_k``) batch element ``b``'s is
    ``offset + seqlens_k[b] - N_k = seqlens_k[b] - N_q`` (:meth:`offset_of`).
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
    packed: PackedSequences | None = None
    per_element: bool = False  # the diagonal follows each batch element's seqlens_k[b]
    dtype: torch.dtype = torch.float32  # the compute dtype biases are built in
    mods: UserMods | None = None  # score_mod, mask_mod and the block mask (flashattn_teach.flex.mods)
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
        cu_seqlens_q: Tensor | None = None,
        cu_seqlens_k: Tensor | None = None,
        offset: int | None = None,
        mods: UserMods | None = None,
    ) -> MaskSpec:
        """``cu_seqlens_q, cu_seqlens_k`` (validated, both or neither) make the call packed: 3-D inputs
        ``(H, total, D)`` whose sequence axis holds the sequences back to back.

        ``offset``, when given, is the diagonal offset itself and replaces ``causal_align``'s: a caller
        that passes a slice of a longer key sequence keeps the whole sequence's geometry with it (a decode
        split of keys ``[s0, s1)`` of a cache of length ``L`` with ``N_q`` new queries: ``L - N_q - s0``;
        see :mod:`flashattn_teach.serving.api`); it is then the same for every batch element. Without it,
        ``bottom_right`` with
        ``seqlens_k`` aligns each batch element to its own length (flash-attn's rule)."""
        left, right = window
        packed = None
        if cu_seqlens_q is not None and cu_seqlens_k is not None:
            packed = PackedSequences.build(cu_seqlens_q, cu_seqlens_k, causal_align)
        if attn_mask is not None:
            rank = len(shapes.score_shape)
            attn_mask = attn_mask.reshape((1,) * (rank - attn_mask.dim()) + tuple(attn_mask.shape))
        return MaskSpec(
            shapes=shapes,
            offset=diagonal_offset(shapes.N_q, shapes.N_k, causal_align) if offset is None else offset,
            causal=causal,
            left=left,
            right=0 if causal else right,  # causal is the window's right side 0, intersected with any window
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            seqlens_k=seqlens_k,
            attn_mask=attn_mask,
            packed=packed,
            per_element=offset is None and causal_align == "bottom_right" and seqlens_k is not None,
            dtype=compute_dtype(q_dtype),
            mods=mods,
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
            "cu_seqlens": self.packed is not None,
        }
        return tuple(name for name, used in named.items() if used) + (() if self.mods is None else self.mods.names)

    @property
    def seqlen_bounds(self) -> tuple[int, int]:
        """``(min, max)`` of ``seqlens_k`` over the batch (``(N_k, N_k)`` without it)."""
        N_k = self.shapes.N_k
        if self.seqlens_k is None or self.seqlens_k.numel() == 0:
            return N_k, N_k
        return int(self.seqlens_k.min()), int(self.seqlens_k.max())

    # ------------------------------------------------- the window, causal, seqlens_k and packed sequences

    def offset_of(self, b: int) -> int:
        """Batch element ``b``'s diagonal offset (flat index): ``offset``, or ``seqlens_k[b] - N_q`` with
        ``per_element``."""
        return self.offset + self._lengths[b] - self.shapes.N_k if self.per_element else self.offset

    def _geometries(self, b: int | None) -> list[tuple[int, int]]:
        """``(off_b, L_b)``, the diagonal offset and key length, of batch element ``b``; with ``b`` None,
        enough of the batch's to decide any tile over the whole batch: every distinct pair with
        ``per_element``, else the shortest and the longest length (one offset; a tile SKIP for the longest
        is SKIP for all, one FULL for the shortest is FULL for all)."""
        if self.seqlens_k is None or not self._lengths:
            return [(self.offset, self.shapes.N_k)]
        if b is not None:
            return [(self.offset_of(b), self._lengths[b])]
        return self._batch_geometries

    @cached_property
    def _batch_geometries(self) -> list[tuple[int, int]]:
        if self.per_element:
            return sorted({(self.offset_of(b), length) for b, length in enumerate(self._lengths)})
        shortest, longest = self.seqlen_bounds
        return sorted({(self.offset, shortest), (self.offset, longest)})

    def key_range(self, r0: int, r1: int, *, b: int | None = None) -> tuple[int, int]:
        """``[c_lo, c_hi)``: the key columns any of the rows ``[r0, r1)`` may see (before ``attn_mask``), in
        batch element ``b`` or (None) in any of them (the hull of theirs)."""
        if self.packed is not None:
            return self.packed.key_range(r0, r1, self.left, self.right)
        ranges = [band_keys(r0, r1, off, self.left, self.right, (0, n)) for off, n in self._geometries(b)]
        seen = [(lo, hi) for lo, hi in ranges if hi > lo]
        if not seen:
            return ranges[0]  # empty
        return min(lo for lo, _ in seen), max(hi for _, hi in seen)

    def query_range(self, c0: int, c1: int, *, b: int | None = None) -> tuple[int, int]:
        """``[r_lo, r_hi)``: the query rows that may see some key of ``[c0, c1)`` (before ``attn_mask``), in
        batch element ``b`` or (None) in any of them (the hull of theirs)."""
        if self.packed is not None:
            return self.packed.query_range(c0, c1, self.left, self.right)
        rows = (0, self.shapes.N_q)
        ranges = [
            band_rows(c0, min(c1, n), off, self.left, self.right, rows) for off, n in self._geometries(b) if c0 < n
        ]
        seen = [(lo, hi) for lo, hi in ranges if hi > lo]
        if not seen:
            return 0, 0
        return min(lo for lo, _ in seen), max(hi for _, hi in seen)

    def structure_kind(self, r0: int, r1: int, c0: int, c1: int, *, b: int | None = None) -> TileKind:
        """The tile's kind under the window, causal, ``seqlens_k`` (of batch element ``b``, flat index;
        None: over the whole batch, SKIP only if SKIP for every element, FULL only if FULL for every one)
        and packed sequences."""
        if self.packed is not None:
            return self.packed.kind(r0, r1, c0, c1, self.left, self.right)
        kinds = set()
        for off, n in self._geometries(b):
            kind = TileKind.SKIP if c0 >= n else band_kind(r0, r1, c0, c1, off, self.left, self.right)
            kinds.add(TileKind.PARTIAL if kind is TileKind.FULL and c1 > n else kind)
        return kinds.pop() if len(kinds) == 1 else TileKind.PARTIAL  # mixed: some element sees part of it

    # ---------------------------------------------------------------------------- tensors of one tile

    def _rank(self) -> int:
        return len(self.shapes.score_shape)

    def _diagonal(self, dtype: torch.dtype, *, b: int | None) -> int | Tensor:
        """``off``, or with ``per_element`` and ``b`` None every element's ``off_b`` as a tensor of shape
        ``(*batch, 1, 1, 1)`` (``()`` for rank 2), broadcastable to the score tile."""
        if not self.per_element:
            return self.offset
        if b is not None:
            return self.offset_of(b)
        assert self.seqlens_k is not None
        lengths = self.seqlens_k.reshape(*self.shapes.batch, *(1,) * (self._rank() - len(self.shapes.batch)))
        return (lengths - self.shapes.N_q).to(dtype)  # off_b = seqlens_k[b] - N_q

    def structure_visible(
        self, r0: int, r1: int, c0: int, c1: int, device: torch.device, *, b: int | None = None
    ) -> Tensor:
        """Bool, broadcastable to the score tile ``(*batch, H_q, Br, Bc)``: window, causal, ``seqlens_k``,
        packed sequences; ``(Br, Bc)`` for batch element ``b`` alone."""
        if self.packed is not None:
            return self.packed.visible(r0, r1, c0, c1, self.left, self.right, device)
        rows = torch.arange(r0, r1, device=device)[:, None]  # (Br, 1)
        cols = torch.arange(c0, c1, device=device)[None, :]  # (1, Bc)
        diagonal = rows + self._diagonal(torch.long, b=b)  # i + off_b: (Br, 1), or (*batch, 1, Br, 1)
        vis = torch.ones(r1 - r0, c1 - c0, dtype=torch.bool, device=device)  # (Br, Bc)
        if self.left >= 0:
            vis = vis & (cols >= diagonal - self.left)
        if self.right >= 0:
            vis = vis & (cols <= diagonal + self.right)
        if self.seqlens_k is not None and b is not None:
            vis &= cols < self._lengths[b]
        elif self.seqlens_k is not None:
            lengths = self.seqlens_k.reshape(*self.shapes.batch, *(1,) * (self._rank() - len(self.shapes.batch)))
            vis = vis & (cols < lengths)  # (*batch, 1, 1, Bc) for rank >= 3, (1, Bc) for rank 2
        return vis

    def alibi_bias(
        self, r0: int, r1: int, c0: int, c1: int, device: torch.device, *, b: int | None = None, h: int = 0
    ) -> Tensor | None:
        """``-slope[b, h] * |i + off_b - j|`` over the tile, broadcastable to the score tile (``(Br, Bc)`` for
        batch element ``b`` and head ``h``); None without ALiBi."""
        if self.alibi_slopes is None:
            return None
        if self.packed is not None:
            return self.packed.alibi_bias(self.alibi_slopes, r0, r1, c0, c1, self.dtype, h=None if b is None else h)
        rows = torch.arange(r0, r1, device=device, dtype=self.dtype)[:, None]  # (Br, 1)
        cols = torch.arange(c0, c1, device=device, dtype=self.dtype)[None, :]  # (1, Bc)
        if b is None and self._rank() == 2:
            b = 0  # 2-D inputs: one batch element, one head
        distance = (rows + self._diagonal(self.dtype, b=b) - cols).abs()  # (Br, Bc), or (*batch, 1, Br, Bc)
        if b is not None:  # one head
            slopes = self.alibi_slopes.reshape(-1, self.shapes.H_q)  # (1 or B, H_q)
            slope = slopes[b if slopes.shape[0] > 1 else 0, h].to(self.dtype)
            return -slope * distance  # (Br, Bc)
        slopes = self.alibi_slopes.to(self.dtype).reshape(*self.alibi_slopes.shape, 1, 1)
        return -slopes * distance  # (*batch, H_q, Br, Bc) or (H_q, Br, Bc)

    def mask_tile(self, r0: int, r1: int, c0: int, c1: int, *, b: int | None = None, h: int = 0) -> Tensor:
        """The user's ``attn_mask`` over the tile (a view), broadcastable to the score tile, or of batch
        element ``b`` (flat index) and query head ``h`` alone."""
        assert self.attn_mask is not None
        m = self.attn_mask
        if b is not None and m.dim() > 2:
            index = (*unravel(b, self.shapes.batch), h)
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
        user: TileKind = TileKind.FULL,
        b: int | None = None,
        h: int = 0,
    ) -> tuple[Tensor | None, Tensor | None]:
        """``(visible, bias)`` of one tile, broadcastable to its scores (or for batch element ``b`` and head
        ``h`` alone), built only where the kinds need it: the structure's mask for a PARTIAL structure, the
        user's bool mask for a PARTIAL mask tile, the block mask and ``mask_mod`` for a PARTIAL ``user``
        tile. An additive mask and ALiBi always add their bias (None when neither is set)."""
        visible = self.structure_visible(r0, r1, c0, c1, device, b=b) if structure is TileKind.PARTIAL else None
        bias = self.alibi_bias(r0, r1, c0, c1, device, b=b, h=h)
        if self.attn_mask is not None and mask is not TileKind.FULL:
            m = self.mask_tile(r0, r1, c0, c1, b=b, h=h)
            if m.dtype == torch.bool:
                visible = m if visible is None else visible & m
            else:
                bias = m.to(self.dtype) if bias is None else bias + m.to(self.dtype)
        if self.mods is not None and user is not TileKind.FULL:
            m = self.user_visible(r0, r1, c0, c1, device, b=b, h=h)
            visible = m if visible is None else visible & m
        return visible, bias

    def tile_index(
        self, r0: int, r1: int, c0: int, c1: int, device: torch.device, *, b: int | None = None, h: int = 0
    ) -> TileIndex:
        """The user functions' indices of a tile: every batch element and head (flat layout), or ``b, h``."""
        if b is not None:
            return TileIndex.head(b, h, (r0, r1), (c0, c1), device)
        return TileIndex.flat(math.prod(self.shapes.batch), self.shapes.H_q, (r0, r1), (c0, c1), device)

    def user_visible(
        self, r0: int, r1: int, c0: int, c1: int, device: torch.device, *, b: int | None = None, h: int = 0
    ) -> Tensor:
        """The block mask and ``mask_mod`` over the tile (:meth:`flashattn_teach.flex.mods.UserMods.visible`),
        broadcastable to the score tile, or ``(Br, Bc)`` for batch element ``b`` and head ``h``."""
        assert self.mods is not None
        index = self.tile_index(r0, r1, c0, c1, device, b=b, h=h)
        if b is not None:
            return self.mods.visible(index, (r1 - r0, c1 - c0))
        s = self.shapes
        flat = to_flat(self.mods.visible(index, (math.prod(s.batch), s.H_q, r1 - r0, c1 - c0)))
        return self.from_flat(flat)

    def from_flat(self, t: Tensor) -> Tensor:
        """A flat-layout tensor ``(B|1, H|1, Br, Bc)`` in the score layout ``(*batch, H_q|1, Br, Bc)`` (size-1
        dims kept; ``(Br, Bc)`` for 2-D inputs)."""
        rank = len(self.shapes.score_shape)
        if rank <= 3:
            return t.reshape(t.shape[-rank:]) if rank == 2 else t.reshape(t.shape[1:])
        batch = self.shapes.batch if t.shape[0] > 1 else (1,) * len(self.shapes.batch)
        return t.reshape(*batch, *t.shape[1:])

    def scores_to_flat(self, S: Tensor) -> Tensor:
        """Score-layout scores ``(*batch, H_q, Br, Bc)`` (all of them, no broadcast dims) -> the flat
        layout ``(B, H_q, Br, Bc)`` the user functions see (a view)."""
        s = self.shapes
        return S.reshape(math.prod(s.batch), s.H_q if len(s.score_shape) > 2 else 1, *S.shape[-2:])

    @cached_property
    def _lengths(self) -> list[int]:
        """``seqlens_k`` by flat batch index, as Python ints (read once per call, not once per tile)."""
        return [] if self.seqlens_k is None else self.seqlens_k.reshape(-1).tolist()

    def dense(self, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
        """``(visible, bias)`` over all ``N_q x N_k`` scores: the dense oracle's masks."""
        N_q, N_k = self.shapes.N_q, self.shapes.N_k
        whole = self.structure_kind(0, N_q, 0, N_k) if N_q and N_k else TileKind.FULL
        structure = TileKind.FULL if whole is TileKind.FULL else TileKind.PARTIAL  # a SKIP matrix is all False
        user = TileKind.FULL if self.mods is None or self.mods.names == ("score_mod",) else TileKind.PARTIAL
        return self.tensors(0, N_q, 0, N_k, device, structure=structure, mask=TileKind.PARTIAL, user=user)

    # ------------------------------------------------------------------------------------------ tilings

    def tiling(self, block_m: int, block_n: int) -> Tiling:
        """The per-tile plan for ``block_m x block_n`` tiles; built once per spec and tiling."""
        key = (block_m, block_n)
        if key not in self._tilings:
            self._tilings[key] = Tiling(self, block_m, block_n)
        return self._tilings[key]
