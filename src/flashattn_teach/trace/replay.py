"""Tile replay: the running statistics of one query block, recorded after every tile update.

For query block ``i`` (rows ``[r0, r1)``) the online softmax folds in one score tile ``S_ij`` per key
block ``j`` (Dao 2023, FlashAttention-2 Alg. 1 lines 8-10):

    m_i = max(m_i, rowmax(S_ij)),   l_i = exp(m_old - m_i) l_i + rowsum(exp(S_ij - m_i)),
    acc = exp(m_old - m_i) acc + exp(S_ij - m_i) V_j

and a replay stores, after each update, ``S_ij``, ``m_i``, ``l_i`` and the partial output
``acc / l_i`` (attention over the keys seen so far), next to the final dense output. The update is the
one in :mod:`flashattn_teach.online_softmax`, called exactly as the CPU references call it, so the replay
and the references cannot drift apart.

``order="key-major"`` replays FlashAttention's Algorithm 1 (Dao et al. 2022): the same tiles of block
``i`` in the same order, but the state goes to "HBM" between them (``O_i = acc / l_i`` is written and
read back as ``acc = O_i * l_i``, Alg. 1 lines 8 and 12-13) while the tiles of other query blocks run in
between; each step records its position in that global schedule.

Tiles wholly above the causal diagonal are never visited, so they are not steps; they are listed in
``Replay.skipped``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .. import online_softmax as osm
from .._layout import compute_dtype
from .._validate import validate_block_sizes, validate_inputs
from ..causal import TileKind, diagonal_offset, tile_kind
from ..reference.dense import dense_attention
from ..reference.query_major import key_end, tile_mask

ORDERS = ("query-major", "key-major")
Tile = tuple[int, int]  # (i, j): query block i, key block j


@dataclass(frozen=True)
class TileStep:
    """The state of query block ``i`` after folding in the tile of key block ``j``.

    ``rows = (r0, r1)`` and ``cols = (c0, c1)`` are half-open; ``completed_columns`` counts the key
    columns that contributed before this tile. ``S_ij (Br, Bc)`` is scaled, ``-inf`` where causally
    masked; ``m_i, l_i (Br,)`` are the values after the update; ``O_partial = acc / l_i`` and
    ``O_final`` (dense attention) are ``(Br, D_v)``; ``max_diff = max |O_partial - O_final|``.
    ``position`` is this update's index in the whole schedule of the chosen loop order and ``done``
    the tiles (of every query block) computed before it.
    """

    index: int
    i: int
    j: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    completed_columns: int
    kind: TileKind
    S_ij: Tensor
    m_i: Tensor
    l_i: Tensor
    O_partial: Tensor
    O_final: Tensor
    max_diff: float
    position: int
    done: tuple[Tile, ...]

    @property
    def masked(self) -> bool:
        """The tile straddles the causal diagonal and ran with a mask."""
        return self.kind is TileKind.PARTIAL

    @property
    def skipped(self) -> bool:
        """Always False: a skipped tile is never visited, so it is never a step (see ``Replay.skipped``)."""
        return self.kind is TileKind.SKIP


@dataclass(frozen=True)
class Replay:
    """One query block's tile updates, in the order the algorithm visits them."""

    steps: tuple[TileStep, ...]
    query_block: int
    rows: tuple[int, int]
    N_q: int
    N_k: int
    block_m: int
    block_n: int
    causal: bool
    causal_align: str
    order: str
    scale: float
    schedule: tuple[Tile, ...]  # every computed tile of every query block, in visiting order
    skipped: tuple[Tile, ...]  # tiles of every query block skipped by causality

    @property
    def diagonal_offset(self) -> int:
        return diagonal_offset(self.N_q, self.N_k, self.causal_align)

    @property
    def T_r(self) -> int:
        return -(-self.N_q // self.block_m)

    @property
    def T_c(self) -> int:
        return -(-self.N_k // self.block_n)

    def grid(self, step: TileStep) -> list[list[str]]:
        """``(T_r, T_c)`` tile states at ``step``: ``current``, ``accumulated`` (this block's earlier tiles),
        ``done`` (other blocks' tiles computed earlier in the schedule), ``skipped`` (causal), ``pending``."""
        done = set(step.done)
        skipped = set(self.skipped)

        def state(tile: Tile) -> str:
            if tile == (step.i, step.j):
                return "current"
            if tile in skipped:
                return "skipped"
            if tile in done:
                return "accumulated" if tile[0] == step.i else "done"
            return "pending"

        return [[state((i, j)) for j in range(self.T_c)] for i in range(self.T_r)]

    def to_experiment(self, *, extensions: bool = False) -> dict:
        """The seed manifest's "experiment" dict; see :mod:`flashattn_teach.trace.manifest`."""
        from .manifest import to_experiment

        return to_experiment(self, extensions=extensions)

    def to_json(self, *, extensions: bool = False, indent: int | None = 2) -> str:
        """``to_experiment()`` as strict JSON (``-inf`` written as ``null``)."""
        from .manifest import to_json

        return to_json(self, extensions=extensions, indent=indent)


def _bounds(index: int, block: int, n: int) -> tuple[int, int]:
    return index * block, min((index + 1) * block, n)


def schedule(
    N_q: int, N_k: int, *, block_m: int, block_n: int, causal: bool, offset: int, order: str
) -> tuple[Tile, ...]:
    """Every tile the loop order computes: the loop bounds of ``query_major.py`` and ``key_major.py``."""
    T_r = -(-N_q // block_m)
    tiles = [
        (i, c0 // block_n)
        for i in range(T_r)
        for c0 in range(0, key_end(min((i + 1) * block_m, N_q), N_k, causal, offset), block_n)
    ]
    if order == "key-major":  # Alg. 1: key blocks j outside, query blocks i inside
        tiles.sort(key=lambda t: (t[1], t[0]))
    return tuple(tiles)


def _pick(t: Tensor, name: str, batch_index: int) -> Tensor:
    """``(N, D)`` or ``(B, N, D)`` -> the ``(N, D)`` matrix of batch element ``batch_index`` (size 1 broadcasts)."""
    if t.dim() not in (2, 3):
        raise ValueError(f"{name} must have shape (N, D) or (B, N, D), got {tuple(t.shape)}")
    return t if t.dim() == 2 else t[0 if t.shape[0] == 1 else batch_index]


def replay(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block_m: int,
    block_n: int,
    query_block: int = 0,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    order: str = "query-major",
    batch_index: int = 0,
) -> Replay:
    """Replay query block ``query_block`` of ``attention(q, k, v)`` one tile update at a time.

    Args:
        q: ``(B, N_q, D)`` or ``(N_q, D)``; k: ``(B, N_k, D)``; v: ``(B, N_k, D_v)``. With ``B > 1`` batch
            element ``batch_index`` is replayed (a size-1 batch broadcasts).
        block_m, block_n: tile sizes ``BLOCK_M x BLOCK_N``; any sizes >= 1.
        query_block: ``i``, the block of query rows ``[i * block_m, min((i + 1) * block_m, N_q))``.
        causal, causal_align: see :mod:`flashattn_teach.causal`.
        scale: softmax scale, default ``1 / sqrt(D)``.
        order: ``"query-major"`` (FlashAttention-2) or ``"key-major"`` (FlashAttention Alg. 1).

    Returns:
        A :class:`Replay`, computed in float64 for float64 inputs and float32 otherwise (as the
        references do), one :class:`TileStep` per computed tile of the block.
    """
    # validate_inputs reads (B, N, D) as (H, N, D); name the batch here so a mismatch reads as one.
    sizes = {
        name: t.shape[0]
        for t, name in ((q, "query"), (k, "key"), (v, "value"))
        if isinstance(t, Tensor) and t.dim() == 3
    }
    B = max(sizes.values(), default=1)
    if any(b not in (1, B) for b in sizes.values()):
        raise ValueError(f"the batch sizes (dim 0) of query, key and value do not broadcast: {sizes}")
    s = validate_inputs(q, k, v, scale=scale, causal_align=causal_align)
    block_m, block_n = validate_block_sizes(block_m, block_n)
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if isinstance(batch_index, bool) or not isinstance(batch_index, int) or not 0 <= batch_index < B:
        raise ValueError(f"batch_index must be an int in [0, {B}) for batch size B={B}, got {batch_index!r}")
    dt = compute_dtype(q.dtype)
    q2, k2, v2 = (_pick(t, name, batch_index).to(dt) for t, name in ((q, "query"), (k, "key"), (v, "value")))
    N_q, N_k, D_v = q2.shape[0], k2.shape[0], v2.shape[-1]
    T_r = -(-N_q // block_m)
    if isinstance(query_block, bool) or not isinstance(query_block, int) or not 0 <= query_block < T_r:
        raise ValueError(f"query_block must be an int in [0, {T_r}) for N_q={N_q}, block_m={block_m}")

    offset = diagonal_offset(N_q, N_k, causal_align)
    order_tiles = schedule(N_q, N_k, block_m=block_m, block_n=block_n, causal=causal, offset=offset, order=order)
    i = query_block
    r0, r1 = _bounds(i, block_m, N_q)
    O_final = dense_attention(q2, k2, v2, causal=causal, causal_align=causal_align, scale=s.scale)[r0:r1]

    q_i = q2[r0:r1]  # (Br, D)
    m_i, l_i, acc = osm.init_state((r1 - r0,), D_v, dtype=dt, device=q2.device)
    steps = []
    for position, (i_t, j) in enumerate(order_tiles):  # the same loop bounds as query_major_forward
        if i_t != i:
            continue
        c0, c1 = _bounds(j, block_n, N_k)
        if order == "key-major":  # read back from HBM (Alg. 1 line 8): acc = O_i * l_i
            acc = osm.normalize(l_i, acc) * l_i.unsqueeze(-1)
        allowed = tile_mask(r0, r1, c0, c1, causal, offset, q2.device)
        S_ij = osm.score_tile(q_i, k2[c0:c1], s.scale, allowed)  # (Br, D) @ (D, Bc) -> (Br, Bc)
        m_i, l_i, acc = osm.update(m_i, l_i, acc, S_ij, v2[c0:c1])
        O_partial = osm.normalize(l_i, acc)  # (Br, D_v)
        steps.append(
            TileStep(
                index=len(steps),
                i=i,
                j=j,
                rows=(r0, r1),
                cols=(c0, c1),
                completed_columns=c0,
                kind=tile_kind(r0, r1, c0, c1, offset) if causal else TileKind.FULL,
                S_ij=S_ij,
                m_i=m_i,
                l_i=l_i,
                O_partial=O_partial,
                O_final=O_final,
                max_diff=float((O_partial - O_final).abs().max()),
                position=position,
                done=order_tiles[:position],
            )
        )
    T_c = -(-N_k // block_n)
    computed = set(order_tiles)
    return Replay(
        steps=tuple(steps),
        query_block=i,
        rows=(r0, r1),
        N_q=N_q,
        N_k=N_k,
        block_m=block_m,
        block_n=block_n,
        causal=causal,
        causal_align=causal_align,
        order=order,
        scale=s.scale,
        schedule=order_tiles,
        skipped=tuple((i_t, j) for i_t in range(T_r) for j in range(T_c) if (i_t, j) not in computed),
    )
