"""Causal masking and the tile geometry built on it: which key column a query row may see, which tiles
are full, partial or skipped, and where the loops over blocks start and end.

Two conventions exist when the number of queries ``N_q`` differs from the number of keys ``N_k``::

    top_left (torch's is_causal)            bottom_right (flash-attn's; a decode step)
    query i sees keys j <= i                query i sees keys j <= i + N_k - N_q

    N_q = 3, N_k = 5                        N_q = 3, N_k = 5
            keys 0 1 2 3 4                          keys 0 1 2 3 4
    query 0      x . . . .                  query 0      x x x . .
    query 1      x x . . .                  query 1      x x x x .
    query 2      x x x . .                  query 2      x x x x x

With ``N_q == N_k`` both are the usual lower triangle. Under ``bottom_right`` with ``N_q > N_k`` the
first ``N_q - N_k`` query rows see no key at all; every backend returns output 0 and ``lse = -inf``
for such rows rather than NaN.

With ``seqlens_k`` (keys ``j >= L_b`` of batch element ``b`` are padding) ``bottom_right`` aligns each
element to its own length, as flash-attn's varlen and KV-cache calls do: the last query row sits at the
element's last key, ``off_b = L_b - N_q``, for causal masking, the window and the ALiBi distance
alike. ``top_left`` keeps ``off = 0`` for every element::

    N_q = 2, N_k = 6, seqlens_k = [6, 4], bottom_right, causal (x: visible, - : padding)

    b = 0, L_0 = 6, off_0 = 4               b = 1, L_1 = 4, off_1 = 2
            keys 0 1 2 3 4 5                        keys 0 1 2 3 4 5
    query 0      x x x x x .                query 0      x x x . - -
    query 1      x x x x x x                query 1      x x x x - -

An offset of ``N_k - N_q = 4`` for every element would let element 1's query 0 see key 3 and put its
diagonal among the padding. A row can see nothing: with ``L_b < N_q`` the first ``N_q - L_b`` rows of
element ``b`` do.
"""

from __future__ import annotations

from enum import Enum

import torch
from torch import Tensor


def diagonal_offset(N_q: int, N_k: int, causal_align: str) -> int:
    """The ``o`` in "query i sees keys j <= i + o"."""
    return 0 if causal_align == "top_left" else N_k - N_q


def visible(rows: Tensor, cols: Tensor, offset: int) -> Tensor:
    """Boolean ``(len(rows), len(cols))`` tile: True where query ``rows[r]`` may see key ``cols[c]``."""
    return cols[None, :] <= rows[:, None] + offset


class TileKind(Enum):
    """How a causal mask meets one (query block, key block) tile."""

    FULL = "full"  # every key visible to every query: run unmasked
    PARTIAL = "partial"  # the tile straddles the diagonal: run with a mask
    SKIP = "skip"  # no key visible to any query: never computed


def tile_kind(r0: int, r1: int, c0: int, c1: int, offset: int) -> TileKind:
    """Classify the tile of query rows ``[r0, r1)`` and key columns ``[c0, c1)``."""
    if c0 > (r1 - 1) + offset:
        return TileKind.SKIP
    if (c1 - 1) <= r0 + offset:
        return TileKind.FULL
    return TileKind.PARTIAL


def key_end(r1: int, N_k: int, causal: bool, offset: int) -> int:
    """One past the last key column any of the query rows ``< r1`` may see: the key loop's bound."""
    return N_k if not causal else max(0, min(N_k, r1 + offset))


def first_visible_row(c0: int, causal: bool, offset: int) -> int:
    """The first query row that sees key column ``c0``; rows above it see nothing of a block starting there."""
    return max(0, c0 - offset) if causal else 0


def tile_mask(
    r0: int, r1: int, c0: int, c1: int, causal: bool, offset: int, device: torch.device | str
) -> Tensor | None:
    """The causal mask of one tile, ``(r1 - r0, c1 - c0)`` bool, or None when the tile is wholly visible
    (it then runs unmasked)."""
    if not causal or tile_kind(r0, r1, c0, c1, offset) is TileKind.FULL:
        return None
    rows = torch.arange(r0, r1, device=device)
    cols = torch.arange(c0, c1, device=device)
    return visible(rows, cols, offset)  # (Br, Bc)


def causal_mask(N_q: int, N_k: int, causal_align: str, device: torch.device | str = "cpu") -> Tensor:
    """The whole ``(N_q, N_k)`` boolean mask; used only by the dense oracle."""
    offset = diagonal_offset(N_q, N_k, causal_align)
    return visible(torch.arange(N_q, device=device), torch.arange(N_k, device=device), offset)
