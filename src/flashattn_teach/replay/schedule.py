"""Which tiles a tiled forward computes, and in which order, for both loop orders, without listing them.

The mask contract (:mod:`flashattn_teach.masks`) decides the key blocks each query block ``i`` visits: every
``j`` whose tile is not SKIP, exactly ``Tiling.key_blocks(i)`` of the CPU references. Without an
``attn_mask`` they form one range ``a_i <= j < b_i`` (causal, a window and ``seqlens_k`` bound the keys a
block of rows sees by two bounds that grow with ``i``), kept as a Python ``range``; with an ``attn_mask``
they are any increasing tuple. The two loop orders visit the tiles as

    query_major   FA2 Alg. 1: for i, for j in cols_i      position(i, j) = sum_{a < i} |cols_a| + index of j in cols_i
    key_major     FA1 Alg. 1: for j, for i in rows_j      position(i, j) = sum_{b < j} |rows_b| + index of i in rows_j

where ``rows_j = {i : j in cols_i}``. Positions come from prefix sums, and without a mask ``cols_i`` and
``rows_j`` are ranges, so a schedule takes ``O(T_r + T_c)`` memory; a list of its tiles would take
``O(T_r T_c)``, 2.5e9 tiles for one causal replay of ``N = 100000`` with 2 x 2 tiles. With a mask the
tuples hold the visited tiles, fewer than the user's own ``N_q x N_k`` mask holds entries.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from itertools import accumulate, islice
from typing import TypeGuard

from ..masks.spec import Tiling

ORDERS = ("query_major", "key_major")
Tile = tuple[int, int]  # (i, j): query block i, key block j


def blocks(n: int, block: int) -> int:
    """``ceil(n / block)``: the number of blocks, the last one ragged."""
    return -(-n // block)


def _find(blocks_: Sequence[int], x: int) -> int | None:
    """The index of ``x`` in the increasing ``blocks_`` (a range or a tuple), or None: O(1) or O(log n)."""
    if isinstance(blocks_, range):
        return x - blocks_.start if x in blocks_ else None
    at = bisect_left(blocks_, x)
    return at if at < len(blocks_) and blocks_[at] == x else None


def _is_tile(tile: object) -> TypeGuard[Tile]:
    return isinstance(tile, tuple) and len(tile) == 2 and all(isinstance(x, int) for x in tile)


def visited_key_blocks(tiling: Tiling, *, b: int, h: int = 0) -> list[Sequence[int]]:
    """``cols_i`` for every query block ``i`` of batch element ``b`` and head ``h``: the key blocks
    ``tiling.key_blocks(i, b=b, h=h)`` visits, as ranges computed from the bounds when there is no mask."""
    if tiling.summary is not None or tiling.user is not None:  # attn_mask or block mask: ask tile by tile
        return [tuple(tiling.key_blocks(i, b=b, h=h)) for i in range(len(tiling.row_blocks))]
    spec, block_n = tiling.spec, tiling.block_n
    length = spec.shapes.N_k if spec.seqlens_k is None else int(spec.seqlens_k.reshape(-1)[b])
    cols: list[Sequence[int]] = []
    last = 0  # b_{i-1}: an empty block keeps the bounds non-decreasing, so rows_j stays one range
    for r0, r1 in tiling.row_blocks:
        lo, hi = spec.key_range(r0, r1, b=b)  # [lo, hi): the keys any row of the block may see
        hi = min(hi, length)
        visited = range(lo // block_n, math.ceil(hi / block_n)) if hi > lo else range(last, last)
        cols.append(visited)
        last = visited.stop
    return cols


class Schedule:
    """Every tile one loop order computes, in visiting order: ``len``, ``[position]``, ``in``, iteration and
    ``index(tile)`` as for a tuple of tiles, each in O(log T) time.

    ``cols[i]`` are the key blocks query block ``i`` visits, increasing (see :func:`visited_key_blocks`).
    """

    def __init__(self, cols: Sequence[Sequence[int]], T_c: int, *, order: str) -> None:
        self.order = order
        self.T_r, self.T_c = len(cols), T_c
        self._cols = cols
        self._rows: list[Sequence[int]]  # rows_j: the query blocks that visit key block j
        ranges = [c for c in cols if isinstance(c, range)]
        if len(ranges) == len(cols):  # a_i and b_i are non-decreasing: rows_j is one range
            starts, stops = [c.start for c in ranges], [c.stop for c in ranges]
            self._rows = [range(bisect_right(stops, j), bisect_right(starts, j)) for j in range(T_c)]
        else:
            rows: list[list[int]] = [[] for _ in range(T_c)]
            for i, js in enumerate(cols):
                for j in js:
                    rows[j].append(i)
            self._rows = [tuple(r) for r in rows]
        outer = cols if order == "query_major" else self._rows
        self._starts = [0, *accumulate(len(x) for x in outer)]  # position of the first tile of each outer block

    def key_blocks(self, i: int) -> Sequence[int]:
        """``cols_i``: the key blocks query block ``i`` computes, in order; it skips the rest."""
        return self._cols[i]

    def query_blocks(self, j: int) -> Sequence[int]:
        """``rows_j``: the query blocks that compute key block ``j``, in order."""
        return self._rows[j]

    def __len__(self) -> int:
        return self._starts[-1]

    def _position(self, tile: object) -> int | None:
        """The position of ``tile``, or None if the schedule never computes it."""
        if not _is_tile(tile):
            return None
        i, j = tile
        if not (0 <= i < self.T_r and 0 <= j < self.T_c):
            return None
        if self.order == "query_major":
            at = _find(self._cols[i], j)
            return None if at is None else self._starts[i] + at
        at = _find(self._rows[j], i)
        return None if at is None else self._starts[j] + at

    def __contains__(self, tile: object) -> bool:
        return self._position(tile) is not None

    def index(self, tile: Tile) -> int:
        """The position of ``tile`` in the schedule; ValueError if the schedule never computes it."""
        position = self._position(tile)
        if position is None:
            raise ValueError(f"tile {tile} is not computed (T_r={self.T_r}, T_c={self.T_c})")
        return position

    def __getitem__(self, position: int) -> Tile:
        if position < 0:
            position += len(self)
        if not 0 <= position < len(self):
            raise IndexError(f"schedule position out of range [0, {len(self)})")
        outer = bisect_right(self._starts, position) - 1  # the block whose run of positions holds it
        inner = position - self._starts[outer]
        if self.order == "query_major":
            return outer, self._cols[outer][inner]
        return self._rows[outer][inner], outer

    def __iter__(self) -> Iterator[Tile]:
        if self.order == "query_major":
            return ((i, j) for i in range(self.T_r) for j in self._cols[i])
        return ((i, j) for j in range(self.T_c) for i in self._rows[j])

    def before(self, position: int) -> Done:
        """The tiles computed before ``position``, of every query block."""
        return Done(self, position)

    def skipped(self) -> Skipped:
        """The tiles never computed, of every query block."""
        return Skipped(self)

    def skipped_key_blocks(self, i: int) -> Iterator[int]:
        """The key blocks query block ``i`` skips, in order (both sides of a window's band)."""
        cols = self._cols[i]
        if isinstance(cols, range):
            yield from range(0, min(cols.start, self.T_c) if cols else self.T_c)
            if cols:
                yield from range(cols.stop, self.T_c)
            return
        visited = set(cols)
        yield from (j for j in range(self.T_c) if j not in visited)


class Done:
    """The first ``position`` tiles of a schedule: ``len``, ``in`` (O(1)) and iteration in visiting order."""

    def __init__(self, schedule: Schedule, position: int) -> None:
        self._schedule, self._position = schedule, position

    def __len__(self) -> int:
        return self._position

    def __contains__(self, tile: object) -> bool:
        position = self._schedule._position(tile)
        return position is not None and position < self._position

    def __iter__(self) -> Iterator[Tile]:
        return islice(self._schedule, self._position)


class Skipped:
    """The tiles of the ``T_r x T_c`` grid a schedule never computes, row by row: ``len``, ``in``, iteration."""

    def __init__(self, schedule: Schedule) -> None:
        self._schedule = schedule

    def __len__(self) -> int:
        return self._schedule.T_r * self._schedule.T_c - len(self._schedule)

    def __contains__(self, tile: object) -> bool:
        s = self._schedule
        if not _is_tile(tile):
            return False
        i, j = tile
        return 0 <= i < s.T_r and 0 <= j < s.T_c and tile not in s

    def __iter__(self) -> Iterator[Tile]:
        s = self._schedule
        return ((i, j) for i in range(s.T_r) for j in s.skipped_key_blocks(i))
