"""The window band on block bounds: which keys a range of query rows may see, and a tile's kind.

Query row ``i`` sees key ``j`` iff ``i + off - left <= j <= i + off + right`` (flash-attn's window; ``-1``:
unbounded on that side; causal is ``right = 0``). Both bounds grow with ``i`` at the same rate, so the
keys a range of rows may see, and the rows that may see a range of keys, are each one interval, and a
tile's kind is arithmetic on its four bounds. ``masks.py`` applies this to a whole call (``off`` from
``causal_align``), ``packed.py`` to each packed sequence (``off`` of that sequence, in packed coordinates).
"""

from __future__ import annotations

from .causal import TileKind


def _clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(x, hi))


def band_keys(r0: int, r1: int, offset: int, left: int, right: int, keys: tuple[int, int]) -> tuple[int, int]:
    """``[c_lo, c_hi)`` within ``keys``: the key columns some row of ``[r0, r1)`` may see (may be empty).

    Row i sees ``i + off - left <= j <= i + off + right``: the first row's lower bound and the last row's
    upper bound."""
    k0, k1 = keys
    lo = k0 if left < 0 else _clamp(r0 + offset - left, k0, k1)
    hi = k1 if right < 0 else _clamp((r1 - 1) + offset + right + 1, k0, k1)
    return lo, max(lo, hi)


def band_rows(c0: int, c1: int, offset: int, left: int, right: int, rows: tuple[int, int]) -> tuple[int, int]:
    """``[r_lo, r_hi)`` within ``rows``: the query rows that may see some key of ``[c0, c1)``.

    Key j is seen by rows ``j - off - right <= i <= j - off + left``."""
    q0, q1 = rows
    lo = q0 if right < 0 else _clamp(c0 - offset - right, q0, q1)
    hi = q1 if left < 0 else _clamp((c1 - 1) - offset + left + 1, q0, q1)
    return lo, max(lo, hi)


def band_kind(r0: int, r1: int, c0: int, c1: int, offset: int, left: int, right: int) -> TileKind:
    """The kind of the (non-empty) tile ``[r0, r1) x [c0, c1)`` under the band alone.

    SKIP when no row of the tile may see a key of it; FULL when the last row's lower bound and the first
    row's upper bound enclose the tile (then every row sees every key)."""
    seen_lo, seen_hi = band_rows(c0, c1, offset, left, right, (r0, r1))
    if seen_lo >= seen_hi:
        return TileKind.SKIP
    full_left = left < 0 or (r1 - 1) + offset - left <= c0
    full_right = right < 0 or r0 + offset + right >= c1 - 1
    return TileKind.FULL if full_left and full_right else TileKind.PARTIAL
