"""A launch's grid in plain Python: the order in which its programs take their (block, batch*head) work, and
each program's work counted from the tile geometry of :mod:`.causal`.

Every attention kernel launches ``n_blocks * B * H`` programs, and the GPU's block scheduler starts them in
program-id order. The kernels map a program id to ``(block, bh)`` in ``program_block``
(:mod:`flashattn_teach.triton.kernels.grid`, ``@triton.jit``); :func:`grid_order` here is its Python
mirror, which the block-scheduler simulation (:mod:`.waves`, ``flashattn-teach kernels --schedule``) and the
replay page's GPU view (:mod:`flashattn_teach.replay.gpu_schedule`) read without triton. A test runs the two
over the same small grids (tests/triton/test_triton_grid_order.py). The orders:

``INDEX``      the block fastest, in index order: head 0's blocks ``0 .. n_blocks - 1``, then head 1's.
``PER_HEAD``   the block fastest, each head's longest block first; the heads one after another.
``LONGEST``    longest first across the whole grid, in groups of ``heads_per_group`` heads whose reused rows
               fit in ``L2_GROUP_BYTES`` (the block rank fastest within a group).

A program's work, in loop iterations (one key block for forward and dQ, one query block for dK/dV):

    work = prologue + (unmasked tiles) + masked_weight * (masked tiles)

with the prologue and epilogue priced as the iterations that move as many bytes (:func:`prologue`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .causal import TileKind, tile_kind
from .tiling import blocks

# The same numbers as the kernels' tl.constexpr INDEX, PER_HEAD, LONGEST and L2_GROUP_BYTES (a test checks).
INDEX, PER_HEAD, LONGEST = 0, 1, 2
ORDERS = {"index": INDEX, "per-head": PER_HEAD, "longest": LONGEST}
L2_GROUP_BYTES = 16 * 1024 * 1024  # a third of an H100/H200's 50 MiB L2
KERNELS = ("forward", "backward_dkdv", "backward_dq")


def heads_per_group(n_rows: int, row_bytes: int) -> int:
    """How many heads' reused rows (``n_rows`` rows of ``row_bytes`` each) fit in ``L2_GROUP_BYTES``."""
    return max(L2_GROUP_BYTES // (n_rows * row_bytes), 1)


def grid_order(
    n_blocks: int, n_bh: int, n_rows: int, order: int, longest_last: bool, row_bytes: int
) -> list[tuple[int, int]]:
    """``(block, bh)`` of program ids ``0 .. n_blocks * n_bh - 1`` (the kernels' ``program_block``).

    ``longest_last``: the last block has the most work (forward and dQ under a causal mask); else the first
    has (dK/dV). ``n_rows`` and ``row_bytes`` size one head's reused operand for ``LONGEST``'s groups."""
    if order not in ORDERS.values():
        raise ValueError(f"order must be one of {sorted(ORDERS.values())} ({', '.join(ORDERS)}), got {order!r}")
    out = []
    group = heads_per_group(n_rows, row_bytes)
    for pid in range(n_blocks * n_bh):
        if order == LONGEST:
            g, r = divmod(pid, group * n_blocks)
            heads = min(group, n_bh - g * group)  # the last group may be smaller
            rank, bh = r // heads, g * group + r % heads  # rank 0: the longest block
        else:
            bh, rank = divmod(pid, n_blocks)
        block = n_blocks - 1 - rank if order != INDEX and longest_last else rank
        out.append((block, bh))
    return out


@dataclass(frozen=True)
class LaunchShape:
    """The attention call whose kernels are simulated: ``(B, H, N, D)`` with ``H_kv = H / group``."""

    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    causal: bool
    group: int = 1
    offset: int = 0  # query row r sees key c <= r + offset (0: top-left, N_k - N_q: bottom-right)


def prologue(kernel: str, block_m: int, block_n: int) -> float:
    """A program's loads and stores outside its loop, in iterations moving as many bytes: forward reads
    ``Q_i`` and writes ``O_i`` (``2 BLOCK_M D``) where an iteration reads ``K_j, V_j`` (``2 BLOCK_N D``);
    dQ reads ``Q_i, dO_i`` and writes ``dQ_i`` (1.5 times that); dK/dV reads ``K_j, V_j`` and writes
    ``dK_j, dV_j`` where an iteration reads ``Q_i, dO_i``."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "backward_dkdv":
        return 2 * block_n / block_m
    return (1.5 if kernel == "backward_dq" else 1.0) * block_m / block_n


def block_work(
    kernel: str,
    shape: LaunchShape,
    block_m: int,
    block_n: int,
    masked_weight: float = 1.0,
    with_prologue: bool = True,
) -> list[float]:
    """Work of each program's block (index ``i`` for forward and dQ, ``j`` for dK/dV), in iterations; without
    the prologue, the tiles it computes (a masked tile weighing ``masked_weight``)."""
    rows, cols = blocks(shape.seq_q, block_m), blocks(shape.seq_k, block_n)
    causal_offset = shape.offset if shape.causal else shape.seq_k  # a bound no row reaches: all visible
    start = prologue(kernel, block_m, block_n) if with_prologue else 0.0

    def cost(r: tuple[int, int], k: tuple[int, int]) -> float:
        kind = tile_kind(r[0], r[1], k[0], k[1], causal_offset)
        return {TileKind.FULL: 1.0, TileKind.PARTIAL: masked_weight, TileKind.SKIP: 0.0}[kind]

    if kernel == "backward_dkdv":  # each of the GROUP query heads of its key head
        return [start + shape.group * sum(cost(r, k) for r in rows) for k in cols]
    return [start + sum(cost(r, k) for k in cols) for r in rows]


def launch_order(kernel: str, shape: LaunchShape, n_blocks: int, order: int) -> list[tuple[int, int]]:
    """``(block, bh)`` of each program in program-id order, as the kernels compute it for ``shape``."""
    dkdv = kernel == "backward_dkdv"
    n_bh = shape.batch * (shape.heads // shape.group if dkdv else shape.heads)
    n_rows = shape.seq_q * shape.group if dkdv else shape.seq_k  # the rows each head's programs all read
    row_bytes = 2 * 2 * shape.head_dim  # a row of both operands, 16-bit, D_v = D
    return grid_order(n_blocks, n_bh, n_rows, order, not dkdv, row_bytes)


def launch_work(
    kernel: str, shape: LaunchShape, block_m: int, block_n: int, order: int, masked_weight: float = 1.0
) -> list[float]:
    """Each program's work in program-id order under ``order`` (the kernels take ``INDEX`` when not causal)."""
    work = block_work(kernel, shape, block_m, block_n, masked_weight)
    return [work[i] for i, _ in launch_order(kernel, shape, len(work), order)]
