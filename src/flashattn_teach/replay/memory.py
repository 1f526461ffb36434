"""Memory, step by step: what is on chip at each tile update, and the HBM bytes the schedule has moved so far.

A tiled forward keeps one tile's working set on chip and streams the rest through HBM. For a replay, either
loop order and any mask (SKIP tiles are never loaded), this module walks the whole schedule of every query
block, since HBM traffic is a property of the schedule, and counts the bytes read and written per tensor by
the rules of :mod:`flashattn_teach.tools.iomodel.hbm` (every load reaches HBM, no cache in between):

    query_major   FA2 Alg. 1: Q_i read once (line 4); K_j, V_j read for every visited tile (line 7);
                  O_i and lse_i written once (lines 14-15). A query block that visits no key block loads
                  nothing and writes O_i = 0 and lse_i, as FA2's kernel does when its key range is empty.
    key_major     FA1 Alg. 1: O, l, m initialised in HBM (line 2) before the first tile; K_j, V_j read
                  once per visited key block (line 6); for every visited tile Q_i, O_i, l_i, m_i read
                  (line 8) and O_i, l_i, m_i written (lines 12-13).

Matrices take ``elem_bytes`` per element (default: the element size of the ``q`` given to ``replay``, 8 for
the float64 teaching example; pass ``elem_bytes=2`` for what a bf16 kernel moves); the per-row statistics
``l, m, lse`` take ``iomodel.STAT_BYTES``, as iomodel counts them. Each step of the replayed query block gets
its position in the schedule and the traffic through that position (``traffic_through``).

At the end of the schedule the per-tensor totals equal iomodel's closed forms, ``query_major_forward_io``
and ``key_major_forward_io`` with ``B = H = 1`` (:func:`closed_form`), whenever iomodel has one: square
self-attention (``N_q = N_k``, ``D = D_v``), plain or causal, with softcap or ALiBi (they change scores, not
tiles). iomodel has no closed form for a window, ``seqlens_k``, ``attn_mask``, packed sequences or a
rectangular problem; for those the walk counts by the same rules and :func:`closed_form` is None.

On chip, at each step: ``Q_i (Br, D)``, ``K_j (Bc, D)``, ``V_j (Bc, D_v)`` at ``elem_bytes``; the score tile
``S_ij``, overwritten by ``P_ij = exp(S_ij - m_i)`` (FA2 Alg. 1 line 9), ``(Br, Bc)``, and ``acc (Br, D_v)``
at the accumulator's size, ``max(elem_bytes, 4)`` (fp32 for 16-bit inputs, fp64 for fp64 as the references
compute); ``m_i, l_i (Br,)`` at ``STAT_BYTES``. Beside it, the dense path (Alg. 0: S and P written to and
read from HBM) in total, from ``iomodel.standard_forward_io`` (for ``N_q != N_k`` or ``D != D_v``, which
iomodel does not cover, by its rule: ``S, P`` are ``N_q x N_k``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..tools.iomodel import (
    STAT_BYTES,
    Problem,
    Traffic,
    key_major_forward_io,
    query_major_forward_io,
    standard_forward_io,
)
from .replay import Replay

__all__ = [
    "MemoryFigure",
    "MemoryStep",
    "OnChip",
    "closed_form",
    "dense_traffic",
    "memory_figure",
    "memory_json",
    "on_chip",
    "traffic_through",
]

# The tensors each order moves (iomodel's keys), so every count names all of them, zeros included.
TENSORS = {
    "query_major": (("Q", "K", "V"), ("O", "lse")),
    "key_major": (("K", "V", "Q", "O", "l", "m"), ("O", "l", "m")),
}
STATS = frozenset({"l", "m", "lse"})  # per-row float32 statistics: STAT_BYTES each
SCORE_VARIANTS = frozenset({"softcap", "alibi_slopes"})  # change the scores but not which tiles are visited


@dataclass(frozen=True)
class OnChip:
    """One buffer held on chip at a step: its paper name, shape and bytes per element."""

    name: str
    shape: tuple[int, ...]
    elem_bytes: int

    @property
    def bytes(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n * self.elem_bytes


@dataclass(frozen=True)
class MemoryStep:
    """Step ``index`` of the replayed query block: at schedule ``position`` (0-based), ``hbm`` is the traffic
    of every tile up to and including this one, ``on_chip`` what the program holds while it runs."""

    index: int
    position: int
    hbm: Traffic
    on_chip: tuple[OnChip, ...]

    @property
    def on_chip_bytes(self) -> int:
        return sum(buffer.bytes for buffer in self.on_chip)


@dataclass(frozen=True)
class MemoryFigure:
    """The memory of a replay: one :class:`MemoryStep` per update, the schedule's total, and the comparisons."""

    order: str
    elem_bytes: int
    schedule_length: int
    steps: tuple[MemoryStep, ...]
    total: Traffic  # the whole schedule, walked
    closed_form: Traffic | None  # iomodel's formula for this order, or None where iomodel has none
    dense: Traffic  # standard attention (Alg. 0), in total


class _Counter:
    """Bytes per tensor, read and written, with every tensor of the order present."""

    def __init__(self, order: str, elem_bytes: int) -> None:
        reads, writes = TENSORS[order]
        self.reads, self.writes = dict.fromkeys(reads, 0), dict.fromkeys(writes, 0)
        self.elem_bytes = elem_bytes

    def _size(self, name: str, elements: int) -> int:
        return elements * (STAT_BYTES if name in STATS else self.elem_bytes)

    def read(self, name: str, elements: int) -> None:
        self.reads[name] += self._size(name, elements)

    def write(self, name: str, elements: int) -> None:
        self.writes[name] += self._size(name, elements)

    def copy(self) -> _Counter:
        c = _Counter.__new__(_Counter)
        c.reads, c.writes, c.elem_bytes = dict(self.reads), dict(self.writes), self.elem_bytes
        return c

    def traffic(self) -> Traffic:
        return Traffic(dict(self.reads), dict(self.writes))


def _extent(blocks: Sequence[tuple[int, int]], picked: Sequence[int]) -> int:
    """Rows (or columns) in the blocks ``picked``: O(1) for a range of consecutive blocks."""
    if isinstance(picked, range):
        return blocks[picked[-1]][1] - blocks[picked[0]][0] if picked else 0
    return sum(blocks[x][1] - blocks[x][0] for x in picked)


def _outer_block(c: _Counter, replay: Replay, outer: int, seen: Sequence[int], *, complete: bool) -> None:
    """Add to ``c`` the traffic of the tiles ``seen`` (the first ones of outer block ``outer``: query block ``i``
    in query-major order, key block ``j`` in key-major), and the block's epilogue if it is ``complete``."""
    tiling = replay.steps.tiling
    rows, cols = tiling.row_blocks, tiling.col_blocks
    D, D_v = replay.steps.q_i.shape[-1], replay.steps.v.shape[-1]
    if replay.order == "query_major":
        br = rows[outer][1] - rows[outer][0]
        if seen:
            c.read("Q", br * D)  # FA2 Alg. 1 line 4: Q_i once
            c.read("K", _extent(cols, seen) * D)  # line 7: K_j, V_j per visited tile
            c.read("V", _extent(cols, seen) * D_v)
        if complete:  # lines 14-15 (also for a block with no tile: O_i = 0 and lse_i are written)
            c.write("O", br * D_v)
            c.write("lse", br)
        return
    if not seen:
        return  # a key block no query block visits is never loaded
    bc, n = cols[outer][1] - cols[outer][0], _extent(rows, seen)
    c.read("K", bc * D)  # FA1 Alg. 1 line 6: K_j, V_j once
    c.read("V", bc * D_v)
    c.read("Q", n * D)  # line 8: Q_i, O_i, l_i, m_i per visited tile
    c.read("O", n * D_v)
    c.read("l", n)
    c.read("m", n)
    c.write("O", n * D_v)  # lines 12-13: O_i, l_i, m_i back to HBM
    c.write("l", n)
    c.write("m", n)


def _walk(replay: Replay, elem_bytes: int, positions: Sequence[int]) -> list[Traffic]:
    """The traffic through each of the increasing ``positions`` (``len(schedule)``: the whole schedule), in one
    pass over the outer loop's blocks: ``O(T_r + T_c + len(positions))`` without an ``attn_mask``."""
    schedule = replay.schedule
    c = _Counter(replay.order, elem_bytes)
    if replay.order == "key_major":  # line 2: O = 0, l = 0, m = -inf in HBM, before the first tile
        N_q, D_v = replay.N_q, replay.steps.v.shape[-1]
        c.write("O", N_q * D_v)
        c.write("l", N_q)
        c.write("m", N_q)
    inner = schedule.key_blocks if replay.order == "query_major" else schedule.query_blocks
    out: list[Traffic] = []
    targets = iter(positions)
    target = next(targets, None)
    start = 0  # the position of the block's first tile; an empty block sits before the next block's first
    for outer in range(schedule.T_r if replay.order == "query_major" else schedule.T_c):
        tiles = inner(outer)
        while target is not None and target < start + len(tiles):  # a target inside this block
            partial = c.copy()
            seen = tiles[: target - start + 1]
            _outer_block(partial, replay, outer, seen, complete=len(seen) == len(tiles))
            out.append(partial.traffic())
            target = next(targets, None)
        _outer_block(c, replay, outer, tiles, complete=True)
        start += len(tiles)
    while target is not None:  # the end of the schedule
        out.append(c.traffic())
        target = next(targets, None)
    return out


def traffic_through(replay: Replay, position: int | None = None, *, elem_bytes: int | None = None) -> Traffic:
    """HBM bytes per tensor of every tile of the schedule up to and including ``position`` (0-based; None:
    the whole schedule), by iomodel's rules for ``replay.order`` (see the module docstring)."""
    eb = _elem_bytes(replay, elem_bytes)
    return _walk(replay, eb, [len(replay.schedule) if position is None else position])[0]


def _elem_bytes(replay: Replay, elem_bytes: int | None) -> int:
    """``elem_bytes``, or the element size of the ``q`` given to ``replay`` (of the replayed rows without it)."""
    if elem_bytes is not None:
        if elem_bytes < 1:
            raise ValueError(f"elem_bytes must be >= 1, got {elem_bytes}")
        return elem_bytes
    q = replay.inputs[0] if replay.call is not None else replay.steps.q_i
    return q.element_size()


def _problem(replay: Replay, elem_bytes: int) -> Problem | None:
    """iomodel's ``Problem`` for this replay (``B = H = 1``), or None when iomodel's formulas do not describe
    it: they assume square self-attention with ``D = D_v``."""
    D, D_v = replay.steps.q_i.shape[-1], replay.steps.v.shape[-1]
    if replay.N_q != replay.N_k or D != D_v:
        return None
    return Problem(1, 1, replay.N_q, D, elem_bytes=elem_bytes, causal=replay.causal)


def closed_form(replay: Replay, *, elem_bytes: int | None = None) -> Traffic | None:
    """iomodel's closed form for the whole schedule of ``replay.order``, or None where iomodel has none (a
    window, ``seqlens_k``, ``attn_mask``, packed sequences, ``N_q != N_k`` or ``D != D_v``)."""
    p = _problem(replay, _elem_bytes(replay, elem_bytes))
    if p is None or not set(replay.variants) <= SCORE_VARIANTS:
        return None
    io = query_major_forward_io if replay.order == "query_major" else key_major_forward_io
    return io(p, replay.block_m, replay.block_n)


def dense_traffic(replay: Replay, *, elem_bytes: int | None = None) -> Traffic:
    """Standard attention (Alg. 0) on the replay's shapes: ``iomodel.standard_forward_io``; for a rectangular
    problem, which iomodel does not cover, the same rule with ``S, P`` of ``N_q x N_k``."""
    eb = _elem_bytes(replay, elem_bytes)
    p = _problem(replay, eb)
    if p is not None:
        return standard_forward_io(p)
    N_q, N_k = replay.N_q, replay.N_k
    D, D_v = replay.steps.q_i.shape[-1], replay.steps.v.shape[-1]
    reads = {"Q": N_q * D, "K": N_k * D, "S": N_q * N_k, "P": N_q * N_k, "V": N_k * D_v}
    writes = {"S": N_q * N_k, "P": N_q * N_k, "O": N_q * D_v}
    return Traffic({k: n * eb for k, n in reads.items()}, {k: n * eb for k, n in writes.items()})


def on_chip(rows: tuple[int, int], cols: tuple[int, int], D: int, D_v: int, elem_bytes: int) -> tuple[OnChip, ...]:
    """What the program holds while it folds in tile ``(rows, cols)`` (FA2 Alg. 1 lines 4-10)."""
    br, bc = rows[1] - rows[0], cols[1] - cols[0]
    acc_bytes = max(elem_bytes, STAT_BYTES)  # fp32 accumulators for 16-bit inputs, fp64 for fp64
    return (
        OnChip("Q_i", (br, D), elem_bytes),
        OnChip("K_j", (bc, D), elem_bytes),
        OnChip("V_j", (bc, D_v), elem_bytes),
        OnChip("S_ij / P_ij", (br, bc), acc_bytes),  # P_ij = exp(S_ij - m_i) overwrites S_ij (line 9)
        OnChip("acc", (br, D_v), acc_bytes),
        OnChip("m_i", (br,), STAT_BYTES),
        OnChip("l_i", (br,), STAT_BYTES),
    )


def memory_figure(replay: Replay, *, elem_bytes: int | None = None) -> MemoryFigure:
    """The replay's memory, step by step (runs no tile update: sizes and positions only)."""
    eb = _elem_bytes(replay, elem_bytes)
    schedule, tiling = replay.schedule, replay.steps.tiling
    D, D_v = replay.steps.q_i.shape[-1], replay.steps.v.shape[-1]
    i = replay.query_block
    positions = [schedule.index((i, j)) for j in schedule.key_blocks(i)]
    *hbm, total = _walk(replay, eb, [*positions, len(schedule)])
    steps = tuple(
        MemoryStep(n, p, traffic, on_chip(tiling.row_blocks[i], tiling.col_blocks[j], D, D_v, eb))
        for n, (j, p, traffic) in enumerate(zip(schedule.key_blocks(i), positions, hbm, strict=True))
    )
    return MemoryFigure(
        order=replay.order,
        elem_bytes=eb,
        schedule_length=len(schedule),
        steps=steps,
        total=total,
        closed_form=closed_form(replay, elem_bytes=eb),
        dense=dense_traffic(replay, elem_bytes=eb),
    )


def _traffic_json(t: Traffic) -> dict[str, Any]:
    return {"reads": dict(t.reads), "writes": dict(t.writes), "read": t.read_bytes, "written": t.write_bytes}


def memory_json(replay: Replay, *, elem_bytes: int | None = None) -> dict[str, Any]:
    """:func:`memory_figure` as plain JSON (integers and strings only): the page's ``memory`` view data."""
    figure = memory_figure(replay, elem_bytes=elem_bytes)
    return {
        "order": figure.order,
        "elemBytes": figure.elem_bytes,
        "statBytes": STAT_BYTES,
        "scheduleLength": figure.schedule_length,
        "total": _traffic_json(figure.total),
        "closedForm": None if figure.closed_form is None else _traffic_json(figure.closed_form),
        "dense": _traffic_json(figure.dense),
        "steps": [
            {
                "index": step.index,
                "position": step.position + 1,
                "hbm": _traffic_json(step.hbm),
                "onChip": [{"name": b.name, "shape": list(b.shape), "bytes": b.bytes} for b in step.on_chip],
                "onChipBytes": step.on_chip_bytes,
            }
            for step in figure.steps
        ],
    }


def build_view(replay: Replay, options: Mapping[str, Any]) -> dict[str, Any]:
    """The page's ``memory`` view (:mod:`.page_views`): :func:`memory_json` at the default element size."""
    return memory_json(replay)
