"""Tile replay: the running statistics of one query block, recorded after every tile update.

For query block ``i`` (rows ``[r0, r1)``) the online softmax folds in one score tile ``S_ij`` per key
block ``j`` (Dao 2023, FlashAttention-2 Alg. 1 lines 8-10):

    m_i = max(m_i, rowmax(S_ij)),   l_i = exp(m_old - m_i) l_i + rowsum(exp(S_ij - m_i)),
    acc = exp(m_old - m_i) acc + exp(S_ij - m_i) V_j

and a replay gives, after each update, ``S_ij``, ``m_i``, ``l_i`` and the partial output
``acc / l_i`` (attention over the keys seen so far), next to the final dense output. The update is the
one in :mod:`flashattn_teach.online_softmax`, called exactly as the CPU references call it, so the replay
and the references cannot drift apart.

``order="key_major"`` replays FlashAttention's Algorithm 1 (Dao et al. 2022): the same tiles of block
``i`` in the same order, but the state goes to "HBM" between them (``O_i = acc / l_i`` is written and
read back as ``acc = O_i * l_i``, Alg. 1 lines 8 and 12-13) while the tiles of other query blocks run in
between; each step records its position in that global schedule (:mod:`.schedule`).

The mask contract (:mod:`flashattn_teach.masks`: causal, ``window``, ``softcap``, ``alibi_slopes``,
``seqlens_k``, ``attn_mask``) decides each tile's kind exactly as it does for the CPU references
(``MaskSpec.build`` and ``Tiling``): SKIP tiles (above the causal diagonal, outside the window's band, past
the key length, hidden by the mask) are never visited, so they are not steps; they are listed in
``Replay.skipped``. Every step records its kind, FULL (no mask work) or PARTIAL (the tile's own mask).

Memory is ``O(N D)`` for any ``N`` (besides a user's own ``attn_mask``): the dense output is computed for the
replayed rows only, from their ``(Br, N_k)`` scores, and the steps are computed when iterated, one tile at
a time, never stored.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from enum import Enum
from itertools import islice

import torch
from torch import Tensor

from .. import online_softmax as osm
from .._layout import compute_dtype
from .._options import AttentionOptions, make_options
from .._validate import check_window, validate_block_sizes
from .._validate_varlen import check_cu_seqlens
from ..causal import TileKind
from ..errors import AttentionTypeError, AttentionValueError
from ..masks import MaskSpec, Tiling
from ..reference.dense import dense_attention
from .schedule import ORDERS, Done, Schedule, Skipped, Tile, blocks, visited_key_blocks

__all__ = ["ORDERS", "Replay", "Steps", "Tile", "TileState", "TileStep", "replay"]


class TileState(Enum):
    """A tile of the ``(T_r, T_c)`` grid at one step of a replay; every renderer draws these."""

    CURRENT = "current"  # folded in at this step
    ACCUMULATED = "accumulated"  # an earlier tile of the replayed query block
    DONE = "done"  # a tile of another query block, computed earlier in the schedule
    SKIPPED = "skipped"  # a SKIP tile (causal, window, seqlens_k or attn_mask): never computed
    PENDING = "pending"  # computed later


@dataclass(frozen=True)
class TileStep:
    """The state of query block ``i`` after folding in the tile of key block ``j``.

    ``rows = (r0, r1)`` and ``cols = (c0, c1)`` are half-open; ``completed_columns`` is ``c0``, the first
    column of this tile (with a window, the columns before it need not all have been visited). ``kind`` is
    the tile's :class:`~flashattn_teach.causal.TileKind` under the mask contract, FULL or PARTIAL.
    ``S_ij (Br, Bc)`` is scaled, capped and biased, ``-inf`` where masked; ``m_i, l_i (Br,)`` are the values
    after the update; ``O_partial = acc / l_i`` and ``O_final`` (dense attention) are ``(Br, D_v)``;
    ``max_diff = max |O_partial - O_final|``. ``position`` is this update's index in the whole schedule of
    the chosen loop order and ``done`` the tiles (of every query block) computed before it.
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
    done: Done

    @property
    def masked(self) -> bool:
        """The tile is PARTIAL and ran with its own mask."""
        return self.kind is TileKind.PARTIAL

    @property
    def skipped(self) -> bool:
        """Always False: a skipped tile is never visited, so it is never a step (see ``Replay.skipped``)."""
        return self.kind is TileKind.SKIP


@dataclass(frozen=True)
class Steps:
    """The tile updates of one query block, computed afresh each time they are iterated: ``len``,
    iteration, and ``[n]`` (which runs the first ``n + 1`` updates)."""

    q_i: Tensor  # (Br, D), the replayed rows
    k: Tensor  # (N_k, D)
    v: Tensor  # (N_k, D_v)
    O_final: Tensor  # (Br, D_v)
    i: int
    rows: tuple[int, int]
    tiling: Tiling
    batch_index: int
    scale: float
    schedule: Schedule

    def __len__(self) -> int:
        return len(self.schedule.key_blocks(self.i))

    def __getitem__(self, n: int) -> TileStep:
        if n < 0:
            n += len(self)
        if not 0 <= n < len(self):
            raise IndexError(f"step index out of range [0, {len(self)})")
        return next(islice(self, n, None))

    def __iter__(self) -> Iterator[TileStep]:
        r0, r1 = self.rows
        b, device, softcap = self.batch_index, self.q_i.device, self.tiling.spec.softcap
        m_i, l_i, acc = osm.init_state((r1 - r0,), self.v.shape[-1], dtype=self.q_i.dtype, device=device)
        # The inner loop of query_major_forward: the key blocks the tiling visits, SKIP tiles left out.
        for n, j in enumerate(self.schedule.key_blocks(self.i)):
            c0, c1 = self.tiling.col_blocks[j]
            if self.schedule.order == "key_major":  # read back from HBM (Alg. 1 line 8): acc = O_i * l_i
                acc = osm.normalize(l_i, acc) * l_i.unsqueeze(-1)
            allowed, bias = self.tiling.head_tile(self.i, j, (r0, r1), b=b, h=0, device=device)  # (Br, Bc) or None
            S_ij = osm.score_tile(self.q_i, self.k[c0:c1], self.scale, allowed, softcap=softcap, bias=bias)
            m_i, l_i, acc = osm.update(m_i, l_i, acc, S_ij, self.v[c0:c1])  # S_ij: (Br, D) @ (D, Bc) -> (Br, Bc)
            O_partial = osm.normalize(l_i, acc)  # (Br, D_v)
            position = self.schedule.index((self.i, j))
            yield TileStep(
                index=n,
                i=self.i,
                j=j,
                rows=(r0, r1),
                cols=(c0, c1),
                completed_columns=c0,
                kind=self.tiling.kind(self.i, j, b=b, h=0),
                S_ij=S_ij,
                m_i=m_i,
                l_i=l_i,
                O_partial=O_partial,
                O_final=self.O_final,
                max_diff=float((O_partial - self.O_final).abs().max()),
                position=position,
                done=self.schedule.before(position),
            )


@dataclass(frozen=True)
class Replay:
    """One query block's tile updates, in the order the algorithm visits them."""

    steps: Steps
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
    schedule: Schedule  # every computed tile of every query block, in visiting order
    skipped: Skipped  # tiles of every query block never computed (SKIP under the mask contract)
    mask: MaskSpec  # the call's mask contract, as the references read it
    batch_index: int = 0

    @property
    def diagonal_offset(self) -> int:
        return self.mask.offset

    @property
    def window(self) -> tuple[int, int]:
        """``(left, right)`` with causal folded in (``right = 0``); ``-1``: unbounded."""
        return self.mask.left, self.mask.right

    @property
    def variants(self) -> tuple[str, ...]:
        """The options beyond plain (causal) attention this replay uses, by argument name."""
        return self.mask.variants

    def labels(self) -> list[str]:
        """The masking options of this replay, one short label each (``causal (top_left)``, ``window (2, 0)``,
        ``softcap 30``, ...), for headings."""
        labels = [f"causal ({self.causal_align})"] if self.causal else []
        for name in self.variants:
            if name == "window":
                labels.append(f"window {self.window}")
            elif name == "softcap":
                labels.append(f"softcap {self.mask.softcap:g}")
            elif name == "seqlens_k":
                assert self.mask.seqlens_k is not None
                labels.append(f"seqlens_k {int(self.mask.seqlens_k.reshape(-1)[self.batch_index])}")
            else:
                labels.append(name)
        return labels

    @property
    def T_r(self) -> int:
        return self.schedule.T_r

    @property
    def T_c(self) -> int:
        return self.schedule.T_c

    def state(self, step: TileStep, tile: Tile) -> TileState:
        """The state of ``tile = (i, j)`` at ``step``."""
        if tile == (step.i, step.j):
            return TileState.CURRENT
        if tile in step.done:
            return TileState.ACCUMULATED if tile[0] == step.i else TileState.DONE
        if tile in self.schedule:
            return TileState.PENDING
        return TileState.SKIPPED

    def grid(self, step: TileStep) -> list[list[TileState]]:
        """``(T_r, T_c)`` tile states at ``step``; ``T_r T_c`` grows as ``N^2``, so draw a window of a large one
        with :meth:`state`."""
        return [[self.state(step, (i, j)) for j in range(self.T_c)] for i in range(self.T_r)]

    def visible(self) -> Tensor:
        """``(N_q, N_k)`` bool: which scores of the replayed batch element count (False where masked or
        ``-inf``). Holds all ``N_q x N_k`` cells: for pictures, which draw every cell anyway."""
        N_q, N_k = self.N_q, self.N_k
        device = self.steps.q_i.device
        kinds = {"structure": TileKind.PARTIAL, "mask": TileKind.PARTIAL}
        allowed, bias = self.mask.tensors(0, N_q, 0, N_k, device, **kinds, b=self.batch_index, h=0)
        cells = torch.ones(N_q, N_k, dtype=torch.bool, device=device)
        if allowed is not None:
            cells &= allowed
        if bias is not None:
            cells &= ~torch.isneginf(bias)
        return cells


def _pick(t: Tensor, name: str, batch_index: int) -> Tensor:
    """``(N, D)`` or ``(B, N, D)`` -> the ``(N, D)`` matrix of batch element ``batch_index`` (size 1 broadcasts)."""
    if t.dim() not in (2, 3):
        raise AttentionValueError(f"{name} must have shape (N, D) or (B, N, D), got {tuple(t.shape)}")
    return t if t.dim() == 2 else t[0 if t.shape[0] == 1 else batch_index]


def _one_head(t: Tensor) -> Tensor:
    """``(N, D)`` or ``(B, N, D)`` -> ``(B, 1, N, D)``: the replay runs one head of a batch (a view)."""
    return t.reshape(1, 1, *t.shape) if t.dim() == 2 else t.unsqueeze(1)


def _index(name: str, value: object, size: int, sizes: str) -> int:
    """``value`` as an index into ``range(size)``, else an error naming the argument and ``sizes``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise AttentionTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not 0 <= value < size:
        raise AttentionValueError(f"{name} must be in [0, {size}) for {sizes}, got {value}")
    return value


def _slopes(alibi_slopes: float | Tensor | None, B: int) -> Tensor | None:
    """One slope (a number) -> ``(1,)`` (the one head's); a ``(B,)`` tensor -> ``(B, 1)`` (per batch element).
    Anything else goes on unchanged, for ``make_options`` to name."""
    if alibi_slopes is None or (isinstance(alibi_slopes, Tensor) and alibi_slopes.shape != (B,)):
        return alibi_slopes
    if isinstance(alibi_slopes, Tensor):
        return alibi_slopes.reshape(B, 1)
    if isinstance(alibi_slopes, bool) or not isinstance(alibi_slopes, (int, float)):
        raise AttentionTypeError(
            f"alibi_slopes must be a number or a tensor of shape ({B},), got {type(alibi_slopes).__name__}"
        )
    return torch.tensor([float(alibi_slopes)], dtype=torch.float64)


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
    order: str = "query_major",
    batch_index: int = 0,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: float | Tensor | None = None,
    seqlens_k: Tensor | None = None,
    attn_mask: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
) -> Replay:
    """Replay query block ``query_block`` of ``attention(q, k, v)`` one tile update at a time.

    Args:
        q: ``(B, N_q, D)`` or ``(N_q, D)``; k: ``(B, N_k, D)``; v: ``(B, N_k, D_v)``. With ``B > 1`` batch
            element ``batch_index`` is replayed (a size-1 batch broadcasts). The replay runs one head.
        block_m, block_n: tile sizes ``BLOCK_M x BLOCK_N``; any sizes >= 1.
        query_block: ``i``, the block of query rows ``[i * block_m, min((i + 1) * block_m, N_q))``.
        causal, causal_align: see :mod:`flashattn_teach.causal`.
        scale: softmax scale, default ``1 / sqrt(D)``.
        order: ``"query_major"`` (FlashAttention-2) or ``"key_major"`` (FlashAttention Alg. 1).
        window, softcap, seqlens_k: as for :func:`flashattn_teach.flash_attention` (see
            :mod:`flashattn_teach.masks`); ``seqlens_k`` has shape ``(B,)``.
        alibi_slopes: one slope (a number, or a ``(1,)`` tensor) or one per batch element (``(B,)``).
        attn_mask: bool (True: visible) or additive, broadcastable to ``(B, N_q, N_k)``, e.g. ``(N_q, N_k)``
            or a left-padding mask ``(B, 1, N_k)``; a 4-D mask is read as Hugging Face's
            ``(B, 1, N_q, N_k)``.
        cu_seqlens: packed sequences (flash-attn's varlen layout) along the one batch element's sequence
            axis, ``(S + 1,)`` boundaries from 0 to ``N`` (``N_q = N_k``): each query sees only the keys of its
            own sequence, causal and the window aligned per sequence (see ``packed.py``); needs ``B = 1``.

    Returns:
        A :class:`Replay`, computed in float64 for float64 inputs and float32 otherwise (as the
        references do), one :class:`TileStep` per visited tile of the block. Its steps are computed
        when iterated; keep the ones you need.

    Raises:
        AttentionTypeError, AttentionValueError (also ``TypeError``, ``ValueError``): a bad argument, named.
    """
    # validate_inputs would read (B, N, D) as (H, N, D); name the batch here so a mismatch reads as one.
    sizes = {
        name: t.shape[0]
        for t, name in ((q, "query"), (k, "key"), (v, "value"))
        if isinstance(t, Tensor) and t.dim() == 3
    }
    B = max(sizes.values(), default=1)
    if any(b not in (1, B) for b in sizes.values()):
        raise AttentionValueError(f"the batch sizes (dim 0) of query, key and value do not broadcast: {sizes}")
    for t, name in ((q, "query"), (k, "key"), (v, "value")):
        if isinstance(t, Tensor):
            _pick(t, name, 0)  # the shape check, before the reshape below
    block_m, block_n = validate_block_sizes(block_m, block_n)
    if order not in ORDERS:
        raise AttentionValueError(f"order must be one of {ORDERS}, got {order!r}")
    batch_index = _index("batch_index", batch_index, B, f"batch size B={B}")
    if isinstance(attn_mask, Tensor) and attn_mask.dim() == 3:
        attn_mask = attn_mask.unsqueeze(-3)  # (B, N_q, N_k) -> (B, 1, N_q, N_k): the one head
    # The one mask contract, built as every CPU path builds it, for (B, 1, N, D): batch B, one head.
    four_d = [_one_head(t) if isinstance(t, Tensor) else t for t in (q, k, v)]
    opts = make_options(
        *four_d,
        causal=causal,
        causal_align=causal_align,
        scale=scale,
        attn_mask=attn_mask,
        window=window,
        softcap=softcap,
        alibi_slopes=_slopes(alibi_slopes, B),
        seqlens_k=seqlens_k,
    )
    if cu_seqlens is not None:
        opts = _packed(opts, q, cu_seqlens, B, causal_align, window)
    dt = compute_dtype(q.dtype)
    q2, k2, v2 = (_pick(t, name, batch_index).to(dt) for t, name in ((q, "query"), (k, "key"), (v, "value")))
    N_q, N_k = q2.shape[0], k2.shape[0]
    i = _index("query_block", query_block, blocks(N_q, block_m), f"N_q={N_q}, block_m={block_m}")

    tiling = opts.mask.tiling(block_m, block_n)
    order_tiles = Schedule(visited_key_blocks(tiling, b=batch_index), len(tiling.col_blocks), order=order)
    r0, r1 = tiling.row_blocks[i]
    q_i = q2[r0:r1]  # (Br, D)
    # The oracle for these rows only: their (Br, N_k) rows of the contract's mask and bias, then dense attention.
    kinds = {"structure": TileKind.PARTIAL, "mask": TileKind.PARTIAL}
    allowed, bias = opts.mask.tensors(r0, r1, 0, N_k, q2.device, **kinds, b=batch_index, h=0)  # (Br, N_k)
    rows_mask = allowed if bias is None else bias if allowed is None else bias.masked_fill(~allowed, float("-inf"))
    O_final = dense_attention(q_i, k2, v2, scale=opts.scale, softcap=opts.mask.softcap, attn_mask=rows_mask)
    steps = Steps(
        q_i=q_i,
        k=k2,
        v=v2,
        O_final=O_final,
        i=i,
        rows=(r0, r1),
        tiling=tiling,
        batch_index=batch_index,
        scale=opts.scale,
        schedule=order_tiles,
    )
    return Replay(
        steps=steps,
        query_block=i,
        rows=(r0, r1),
        N_q=N_q,
        N_k=N_k,
        block_m=block_m,
        block_n=block_n,
        causal=opts.causal,
        causal_align=causal_align,
        order=order,
        scale=opts.scale,
        schedule=order_tiles,
        skipped=order_tiles.skipped(),
        mask=opts.mask,
        batch_index=batch_index,
    )


def _packed(
    opts: AttentionOptions, q: Tensor, cu_seqlens: Tensor, B: int, causal_align: str, window: tuple[int, int] | None
) -> AttentionOptions:
    """``opts`` with the packed sequences of ``cu_seqlens`` in the mask contract (the same boundaries for the
    queries and the keys, as in self-attention over a packed batch)."""
    s = opts.shapes
    if B != 1 or s.N_q != s.N_k:
        raise AttentionValueError(
            f"cu_seqlens packs sequences along one sequence axis: it needs B = 1 and N_q = N_k, got B={B}, "
            f"N_q={s.N_q}, N_k={s.N_k}"
        )
    cu = check_cu_seqlens("cu_seqlens", cu_seqlens, s.N_q, "N", q.device)
    mask = MaskSpec.build(
        s,
        q.dtype,
        causal=opts.causal,
        causal_align=causal_align,
        window=check_window(window),
        softcap=opts.mask.softcap,
        alibi_slopes=opts.mask.alibi_slopes,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
    )
    return replace(opts, mask=mask)
