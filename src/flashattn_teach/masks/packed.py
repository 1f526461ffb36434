"""Packed variable-length sequences (flash-attn's varlen layout) in the mask contract.

``B`` sequences lie back to back on one packed axis: sequence ``b`` holds query rows
``cu_seqlens_q[b] <= i < cu_seqlens_q[b + 1]`` and key columns ``cu_seqlens_k[b] <= j < cu_seqlens_k[b + 1]``.
Row ``i`` of sequence ``b`` sees column ``j`` only if ``j`` is in sequence ``b`` too, and then under the
window and causal rule in the sequence's own coordinates, ``i' = i - cu_q[b]``, ``j' = j - cu_k[b]``, with
the diagonal offset of ``causal_align`` per sequence (``top_left``: 0, ``bottom_right``:
``len_k[b] - len_q[b]``, as flash-attn's varlen functions align causal masking)::

    i' + off_b - left <= j' <= i' + off_b + right   <=>   i + o_b - left <= j <= i + o_b + right,
    o_b = cu_k[b] - cu_q[b] + off_b                 (the sequence's diagonal in packed coordinates)

so every sequence is the window band of ``window.py`` with its own offset ``o_b``, cut to its own block of
rows and columns (the block diagonal). ALiBi's distance is ``|i' + off_b - j'| = |i + o_b - j|``. Three
sequences, ``len_q = len_k = (2, 3, 1)``, causal (x: visible)::

          keys 0 1 2 3 4 5
        q 0    x . . . . .
        q 1    x x . . . .
        q 2    . . x . . .
        q 3    . . x x . .
        q 4    . . x x x .
        q 5    . . . . . x

A tile whose rows and columns all lie in one sequence gets that band's kind; a tile that crosses a
boundary is PARTIAL, or SKIP when no sequence's band meets it. Element masks come from per-row and
per-column sequence ids built for one tile (``O(Br + Bc)``), never from an ``N x N`` table.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import torch
from torch import Tensor

from .causal import TileKind
from .window import band_keys, band_kind, band_rows


@dataclass(frozen=True)
class PackedSequences:
    """The sequence bounds of one packed call: as Python ints for the tile arithmetic (read once per
    call, not once per tile) and as tensors on the inputs' device for the per-tile masks."""

    cu_q: tuple[int, ...]  # (B + 1,) query row bounds
    cu_k: tuple[int, ...]  # (B + 1,) key column bounds
    diagonals: tuple[int, ...]  # (B,) o_b: sequence b's diagonal offset in packed coordinates
    cu_q_t: Tensor
    cu_k_t: Tensor
    diagonals_t: Tensor

    @staticmethod
    def build(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, causal_align: str) -> PackedSequences:
        """From validated ``cu_seqlens`` (``(B + 1,)``, from 0, non-decreasing, last = the packed length)."""
        cu_q, cu_k = tuple(cu_seqlens_q.tolist()), tuple(cu_seqlens_k.tolist())
        # top_left: o_b = cu_k[b] - cu_q[b]; bottom_right adds len_k - len_q, which gives cu_k[b+1] - cu_q[b+1].
        end = 1 if causal_align == "bottom_right" else 0
        diagonals = tuple(cu_k[b + end] - cu_q[b + end] for b in range(len(cu_q) - 1))
        device = cu_seqlens_q.device
        return PackedSequences(
            cu_q=cu_q,
            cu_k=cu_k,
            diagonals=diagonals,
            cu_q_t=cu_seqlens_q.to(torch.int64),
            cu_k_t=cu_seqlens_k.to(device=device, dtype=torch.int64),
            diagonals_t=torch.tensor(diagonals, dtype=torch.int64, device=device),
        )

    @property
    def longest_q(self) -> int:
        """The longest query sequence (flash-attn's ``max_seqlen_q``, exactly)."""
        return max((b - a for a, b in zip(self.cu_q, self.cu_q[1:], strict=False)), default=0)

    @property
    def longest_k(self) -> int:
        return max((b - a for a, b in zip(self.cu_k, self.cu_k[1:], strict=False)), default=0)

    @property
    def batch(self) -> int:
        return len(self.cu_q) - 1

    def _rows(self, b: int) -> tuple[int, int]:
        return self.cu_q[b], self.cu_q[b + 1]

    def _keys(self, b: int) -> tuple[int, int]:
        return self.cu_k[b], self.cu_k[b + 1]

    def row_sequence(self, i: int) -> int:
        """The sequence of packed query row ``i`` (an empty sequence holds no row: the last ``b`` with
        ``cu_q[b] <= i``)."""
        return bisect_right(self.cu_q, i) - 1

    def key_sequence(self, j: int) -> int:
        """The sequence of packed key column ``j``."""
        return bisect_right(self.cu_k, j) - 1

    # ------------------------------------------------------------------------------ tile arithmetic

    def key_range(self, r0: int, r1: int, left: int, right: int) -> tuple[int, int]:
        """``[c_lo, c_hi)``: the key columns some row of ``[r0, r1)`` may see.

        Row i's first and last visible columns, clamped to its sequence's keys, grow with i within a
        sequence and jump forward to the next sequence's keys: the first row's lower bound and the last
        row's upper bound enclose every row's columns."""
        if r0 >= r1:
            return 0, 0
        first, last = self.row_sequence(r0), self.row_sequence(r1 - 1)
        lo, _ = band_keys(r0, r0 + 1, self.diagonals[first], left, right, self._keys(first))
        _, hi = band_keys(r1 - 1, r1, self.diagonals[last], left, right, self._keys(last))
        return lo, max(lo, hi)

    def query_range(self, c0: int, c1: int, left: int, right: int) -> tuple[int, int]:
        """``[r_lo, r_hi)``: the query rows that may see some key of ``[c0, c1)`` (as :meth:`key_range`)."""
        if c0 >= c1:
            return 0, 0
        first, last = self.key_sequence(c0), self.key_sequence(c1 - 1)
        lo, _ = band_rows(c0, c0 + 1, self.diagonals[first], left, right, self._rows(first))
        _, hi = band_rows(c1 - 1, c1, self.diagonals[last], left, right, self._rows(last))
        return lo, max(lo, hi)

    def kind(self, r0: int, r1: int, c0: int, c1: int, left: int, right: int) -> TileKind:
        """The tile's kind: each sequence's band on the part of the tile in that sequence's block."""
        first = max(self.row_sequence(r0), self.key_sequence(c0))
        last = min(self.row_sequence(r1 - 1), self.key_sequence(c1 - 1))
        kinds = []
        for b in range(first, last + 1):  # the sequences that own both some row and some column of the tile
            (q0, q1), (k0, k1) = self._rows(b), self._keys(b)
            rows, cols = (max(r0, q0), min(r1, q1)), (max(c0, k0), min(c1, k1))
            if rows[0] < rows[1] and cols[0] < cols[1]:
                kinds.append(band_kind(*rows, *cols, self.diagonals[b], left, right))
        if all(kind is TileKind.SKIP for kind in kinds):  # also when no sequence owns both
            return TileKind.SKIP
        (q0, q1), (k0, k1) = self._rows(first), self._keys(first)
        inside = first == last and q0 <= r0 and r1 <= q1 and k0 <= c0 and c1 <= k1
        return kinds[0] if inside else TileKind.PARTIAL  # a tile across a boundary holds cross-sequence pairs

    # ------------------------------------------------------------------------------- tile tensors

    def _ids(self, r0: int, r1: int, c0: int, c1: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """Per-row sequence ids ``(Br,)``, per-column ids ``(Bc,)`` and each row's diagonal ``i + o_b``."""
        rows = torch.arange(r0, r1, device=device)
        cols = torch.arange(c0, c1, device=device)
        seq_r = torch.searchsorted(self.cu_q_t, rows, right=True) - 1  # (Br,): last b with cu_q[b] <= i
        seq_c = torch.searchsorted(self.cu_k_t, cols, right=True) - 1  # (Bc,)
        return seq_r, seq_c, rows + self.diagonals_t[seq_r]

    def visible(self, r0: int, r1: int, c0: int, c1: int, left: int, right: int, device: torch.device) -> Tensor:
        """``(Br, Bc)`` bool: same sequence, and inside that sequence's band."""
        seq_r, seq_c, diag = self._ids(r0, r1, c0, c1, device)
        cols = torch.arange(c0, c1, device=device)[None, :]  # (1, Bc)
        vis = seq_r[:, None] == seq_c[None, :]  # (Br, Bc): the block diagonal
        if left >= 0:
            vis &= cols >= diag[:, None] - left
        if right >= 0:
            vis &= cols <= diag[:, None] + right
        return vis

    def alibi_bias(
        self, slopes: Tensor, r0: int, r1: int, c0: int, c1: int, dtype: torch.dtype, *, h: int | None
    ) -> Tensor:
        """``-slope * |i + o_b - j|`` over the tile: ``(Br, Bc)`` for query head ``h``, else ``(H_q, Br, Bc)``.

        ``slopes`` is ``(H_q,)`` or ``(B, H_q)`` (one row per sequence, picked by each query row's sequence);
        the distance across sequences is never seen (those scores are masked)."""
        device = slopes.device
        seq_r, _, diag = self._ids(r0, r1, c0, c1, device)
        cols = torch.arange(c0, c1, device=device, dtype=dtype)[None, :]  # (1, Bc)
        distance = (diag.to(dtype)[:, None] - cols).abs()  # (Br, Bc)
        per_row = slopes.to(dtype)[seq_r] if slopes.dim() == 2 else slopes.to(dtype).expand(len(seq_r), -1)  # (Br, H_q)
        if h is not None:
            return -per_row[:, h, None] * distance  # (Br, 1) * (Br, Bc)
        return -per_row.t()[:, :, None] * distance  # (H_q, Br, 1) * (Br, Bc) -> (H_q, Br, Bc)
