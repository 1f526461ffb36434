"""How a sequence is split over the ranks of a ring, and which (query chunk, key chunk) pairs each rank computes.

The sequence of ``N`` positions is cut into equal chunks. Two layouts:

    contiguous   W chunks of N/W; rank r holds chunk r, positions [r N/W, (r+1) N/W)
    zigzag       2W chunks of N/(2W); rank r holds chunks r and 2W-1-r, concatenated in that order

Under causal masking a pair (query chunk a, key chunk b) is FULL (b < a: every key visible), diagonal
(b == a: the causal triangle; :class:`~flashattn_teach.masks.causal.TileKind` calls it PARTIAL) or SKIP (b > a).
With the contiguous layout rank r has r full pairs and one diagonal, so the last rank works W times as
long as the first; zigzag pairs an early chunk with a late one and gives every rank 2W-1 full pairs and
two diagonals (Brandon et al. 2023, "Striped Attention", arXiv:2311.09431, balance causal ring attention
the same way with a finer stripe; the zigzag form is the one of ring-flash-attention and of Llama 3's
context parallelism).

:func:`ring_schedule` is the plan the ring runs (:mod:`.ring` calls it); :func:`visited_tiles` and
:func:`picture` (the global chunk grid as text: which rank computes each pair, at which ring step) read
the same plan, so what they report is what the ring computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import AttentionValueError
from ..masks.causal import TileKind, tile_kind

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise AttentionValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return str(layout)


def num_chunks(world_size: int, layout: str) -> int:
    """How many equal chunks the sequence is cut into: ``W`` (contiguous) or ``2W`` (zigzag)."""
    return world_size if check_layout(layout) == "contiguous" else 2 * world_size


def chunk_ids(world_size: int, rank: int, layout: str) -> tuple[int, ...]:
    """The global chunks rank ``rank`` holds, in the order they are concatenated in its shard."""
    if check_layout(layout) == "contiguous":
        return (rank,)
    return (rank, 2 * world_size - 1 - rank)


def shard(x: Tensor, world_size: int, rank: int, layout: str, dim: int = -2) -> Tensor:
    """Rank ``rank``'s shard of the full sequence ``x`` along ``dim`` (a new tensor, not a view)."""
    n_chunks = num_chunks(world_size, layout)
    N = x.shape[dim]
    if N % n_chunks != 0:
        raise AttentionValueError(
            f"x has {N} positions along dim {dim} (shape {tuple(x.shape)}); the {layout} layout over "
            f"world_size={world_size} ranks cuts it into {n_chunks} equal chunks, so N must be a multiple of "
            f"{n_chunks}"
        )
    if not 0 <= rank < world_size:
        raise AttentionValueError(f"rank must be in [0, {world_size}), got {rank}")
    chunks = x.chunk(n_chunks, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(world_size, rank, layout)], dim=dim)


def unshard(shards: list[Tensor] | tuple[Tensor, ...], layout: str, dim: int = -2) -> Tensor:
    """The full sequence from every rank's shard (``shards[r]`` from rank ``r``); inverse of :func:`shard`."""
    W = len(shards)
    per_rank = len(chunk_ids(W, 0, layout))
    chunks: list[Tensor | None] = [None] * num_chunks(W, layout)
    for r, s in enumerate(shards):
        if s.shape[dim] % per_rank != 0:
            raise AttentionValueError(
                f"shards[{r}] has shape {tuple(s.shape)}: the {layout} layout needs a multiple of {per_rank} "
                f"positions along dim {dim}"
            )
        for c, piece in zip(chunk_ids(W, r, layout), s.chunk(per_rank, dim=dim), strict=True):
            chunks[c] = piece
    return torch.cat([c for c in chunks if c is not None], dim=dim)


def pair_kind(q_chunk: int, k_chunk: int, causal: bool) -> TileKind:
    """How the causal mask meets the pair (global query chunk, global key chunk)."""
    if not causal or k_chunk < q_chunk:
        return TileKind.FULL
    return TileKind.PARTIAL if k_chunk == q_chunk else TileKind.SKIP


@dataclass(frozen=True)
class BlockCall:
    """One call of the local attention backend: some of the local query chunks against some of the chunks
    of the key/value shard that arrived from ``source`` at ring step ``step``.

    ``q_chunks`` and ``k_chunks`` are positions inside the shards (0, or 0 and 1 in zigzag), contiguous,
    so that the call reads one slice ``[start, stop)`` of each shard.
    """

    step: int
    source: int
    q_chunks: tuple[int, ...]
    k_chunks: tuple[int, ...]
    causal: bool

    def q_rows(self, chunk_len: int) -> slice:
        return slice(self.q_chunks[0] * chunk_len, (self.q_chunks[-1] + 1) * chunk_len)

    def k_rows(self, chunk_len: int) -> slice:
        return slice(self.k_chunks[0] * chunk_len, (self.k_chunks[-1] + 1) * chunk_len)


def ring_schedule(world_size: int, rank: int, layout: str, causal: bool) -> list[list[BlockCall]]:
    """Per ring step ``s``, the backend calls of rank ``rank``, whose key/value shard then comes from rank
    ``(rank - s) mod W``.

    A step that meets the diagonal (the rank's own shard, step 0) is one causal call over the whole shard:
    both layouts keep a shard's chunks in increasing order, so the local top-left mask is the global one.
    Any other step visits only FULL pairs, which in both layouts form one rectangle of chunks: one
    unmasked call over it, or none when every pair is skipped.
    """
    q_ids = chunk_ids(world_size, rank, layout)
    steps: list[list[BlockCall]] = []
    for step in range(world_size):
        source = (rank - step) % world_size
        k_ids = chunk_ids(world_size, source, layout)
        kinds = {(a, b): pair_kind(qc, kc, causal) for a, qc in enumerate(q_ids) for b, kc in enumerate(k_ids)}
        every_q, every_k = tuple(range(len(q_ids))), tuple(range(len(k_ids)))
        if TileKind.PARTIAL in kinds.values():
            steps.append([BlockCall(step, source, every_q, every_k, causal=True)])
            continue
        full = [pair for pair, kind in kinds.items() if kind is TileKind.FULL]
        if not full:
            steps.append([])
            continue
        rows = tuple(sorted({a for a, _ in full}))
        cols = tuple(sorted({b for _, b in full}))
        if len(full) != len(rows) * len(cols):  # holds for both layouts; a new layout must keep it
            raise AssertionError(f"the visible pairs {full} of rank {rank} at step {step} are not a rectangle")
        steps.append([BlockCall(step, source, rows, cols, causal=False)])
    return steps


def call_tiles(n_q: int, n_k: int, causal: bool, block_m: int, block_n: int) -> int:
    """The (query block i, key block j) tiles a tiled backend visits for one ``n_q x n_k`` call: all of
    them, or under top-left causal masking those not wholly above the diagonal."""
    return sum(
        1
        for r0 in range(0, n_q, block_m)
        for c0 in range(0, n_k, block_n)
        if not causal or tile_kind(r0, min(r0 + block_m, n_q), c0, min(c0 + block_n, n_k), 0) is not TileKind.SKIP
    )


def visited_tiles(seq_len: int, world_size: int, layout: str, causal: bool, block_m: int, block_n: int) -> list[int]:
    """Per rank, the ``block_m x block_n`` tiles its backend calls visit over the whole ring, from
    :func:`ring_schedule`. With zigzag and block sizes dividing ``N / (2W)``, every rank visits as many
    tiles under causal masking; with contiguous, rank r visits about ``2r + 1`` times the first's."""
    chunk_len = seq_len // num_chunks(world_size, layout)
    return [
        sum(
            call_tiles(len(c.q_chunks) * chunk_len, len(c.k_chunks) * chunk_len, c.causal, block_m, block_n)
            for calls in ring_schedule(world_size, rank, layout, causal)
            for c in calls
        )
        for rank in range(world_size)
    ]


MAX_WORLD_SIZE = 8  # one digit per cell and two grids side by side stay within 80 columns


def _cells(world_size: int, layout: str) -> dict[tuple[int, int], tuple[int, int, TileKind]]:
    """``(query chunk, key chunk) -> (rank, step, kind)`` for every pair a rank computes."""
    cells: dict[tuple[int, int], tuple[int, int, TileKind]] = {}
    for rank in range(world_size):
        q_ids = chunk_ids(world_size, rank, layout)
        for calls in ring_schedule(world_size, rank, layout, causal=True):
            for call in calls:
                k_ids = chunk_ids(world_size, call.source, layout)
                for a in call.q_chunks:
                    for b in call.k_chunks:
                        kind = pair_kind(q_ids[a], k_ids[b], causal=True)
                        if kind is not TileKind.SKIP:
                            cells[q_ids[a], k_ids[b]] = (rank, call.step, kind)
    return cells


def picture(world_size: int, layout: str) -> str:
    """Fixed-width text (at most 80 columns): for causal attention over ``world_size`` ranks in ``layout``,
    the grid of chunk pairs with the rank that computes each and the ring step at which it does, then the
    work per rank in chunk pairs (a diagonal pair, half masked, counts 1/2)."""
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise AttentionValueError(f"picture draws 1 to {MAX_WORLD_SIZE} ranks, got world_size={world_size}")
    n = num_chunks(world_size, layout)
    cells = _cells(world_size, layout)
    owner = {c: r for r in range(world_size) for c in chunk_ids(world_size, r, layout)}
    holds = "chunk r" if layout == "contiguous" else f"chunks r and {n - 1}-r"
    lines = [
        f"causal ring attention, {layout} layout, W = {world_size} ranks",
        f"{n} chunks of N/{n}; rank r holds {holds}",
        "row: query chunk, column: key chunk, '.': skipped, diagonal: half masked",
        "",
    ]
    keys = " ".join(str(b % 10) for b in range(n))
    width = 2 * n - 1
    lines.append(f"{'':14}{'computed by rank':<{width}}    {'at ring step':<{width}}".rstrip())
    lines.append(f"{'query  (rank)':14}{keys}    {keys}")
    for a in range(n):
        by_rank = " ".join(str(cells[a, b][0]) if (a, b) in cells else "." for b in range(n))
        by_step = " ".join(str(cells[a, b][1]) if (a, b) in cells else "." for b in range(n))
        lines.append(f"{a:>5}  ({owner[a]}){'':4}{by_rank}    {by_step}")
    pair_size = (world_size / n) ** 2  # one (N/n x N/n) chunk pair in (N/W x N/W) blocks
    work = [0.0] * world_size
    for rank, _, kind in cells.values():
        work[rank] += pair_size * (0.5 if kind is TileKind.PARTIAL else 1.0)
    lines.append("")
    lines.append("work per rank, in blocks of N/W x N/W scores:")
    lines.append("  ".join(f"{r}: {w:g}" for r, w in enumerate(work)))
    return "\n".join(lines)
