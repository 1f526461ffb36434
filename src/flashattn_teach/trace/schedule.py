"""Which tiles a tiled forward computes, and in which order, for both loop orders, without listing them.

Query block ``i`` (rows ``[i Br, min((i + 1) Br, N_q))``) computes key blocks ``j = 0 .. n_i - 1``, where
``n_i = ceil(key_end / Bc)`` is the inner loop's bound in ``reference/query_major.py`` (all ``T_c`` blocks
unless causal); the tiles with ``j >= n_i`` lie above the causal diagonal and are skipped. A later query
row never sees fewer keys, so ``n_i`` never decreases with ``i``. The two loop orders visit the tiles as

    query_major   FA2 Alg. 1: for i, for j < n_i         position(i, j) = sum_{a < i} n_a + j
    key_major     FA1 Alg. 1: for j, for i >= first_j    position(i, j) = sum_{b < j} (T_r - first_b) + i - first_j

where ``first_j`` is the first query block with ``n_i > j``. Both positions come from prefix sums, so a
schedule takes ``O(T_r + T_c)`` memory; a list of its tiles would take ``O(T_r T_c)``, 2.5e9 tiles for one
replay of ``N = 100000`` with 2 x 2 tiles.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator
from itertools import accumulate, islice

from ..causal import key_end

ORDERS = ("query_major", "key_major")
Tile = tuple[int, int]  # (i, j): query block i, key block j


def blocks(n: int, block: int) -> int:
    """``ceil(n / block)``: the number of blocks, the last one ragged."""
    return -(-n // block)


class Schedule:
    """Every tile one loop order computes, in visiting order: ``len``, ``[position]``, ``in``, iteration and
    ``index(tile)`` as for a tuple of tiles, each in O(log T) time."""

    def __init__(
        self, N_q: int, N_k: int, *, block_m: int, block_n: int, causal: bool, offset: int, order: str
    ) -> None:
        self.order = order
        self.T_r, self.T_c = blocks(N_q, block_m), blocks(N_k, block_n)
        self._n = [blocks(key_end(min((i + 1) * block_m, N_q), N_k, causal, offset), block_n) for i in range(self.T_r)]
        if order == "query_major":  # _starts[i]: position of tile (i, 0)
            self._starts = [0, *accumulate(self._n)]
        else:  # _first[j]: first_j above; _starts[j]: position of tile (first_j, j)
            self._first = [bisect_right(self._n, j) for j in range(self.T_c)]
            self._starts = [0, *accumulate(self.T_r - f for f in self._first)]

    def key_blocks(self, i: int) -> int:
        """``n_i``: query block ``i`` computes key blocks ``0 .. n_i - 1`` and skips the rest."""
        return self._n[i]

    def __len__(self) -> int:
        return self._starts[-1]

    def _position(self, tile: object) -> int | None:
        """The position of ``tile``, or None if the schedule never computes it."""
        if not (isinstance(tile, tuple) and len(tile) == 2 and all(isinstance(x, int) for x in tile)):
            return None
        i, j = tile
        if not (0 <= i < self.T_r and 0 <= j < self._n[i]):
            return None
        if self.order == "query_major":
            return self._starts[i] + j
        return self._starts[j] + i - self._first[j]

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
            return outer, inner
        return self._first[outer] + inner, outer

    def __iter__(self) -> Iterator[Tile]:
        if self.order == "query_major":
            return ((i, j) for i in range(self.T_r) for j in range(self._n[i]))
        return ((i, j) for j in range(self.T_c) for i in range(self._first[j], self.T_r))

    def before(self, position: int) -> Done:
        """The tiles computed before ``position``, of every query block."""
        return Done(self, position)

    def skipped(self) -> Skipped:
        """The tiles never computed, of every query block."""
        return Skipped(self)


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
        if not (isinstance(tile, tuple) and len(tile) == 2 and all(isinstance(x, int) for x in tile)):
            return False
        i, j = tile
        return 0 <= i < s.T_r and s.key_blocks(i) <= j < s.T_c

    def __iter__(self) -> Iterator[Tile]:
        s = self._schedule
        return ((i, j) for i in range(s.T_r) for j in range(s.key_blocks(i), s.T_c))
