"""The order in which a one-dimensional grid's programs take their (block, batch*head) work.

Every attention kernel here launches ``n_blocks * B * H`` programs, and the GPU's block scheduler starts them
in program-id order, each on the first SM slot that frees up. Under a causal mask the programs' work differs:
forward and dQ query block ``i`` visits about ``i + 1`` key blocks, dK/dV key block ``j`` about
``n_blocks - j`` query blocks. Started in index order, the longest programs come last and run alone in the
tail of the launch; started longest first, the short ones fill the gaps the long ones leave (the greedy
list-scheduling rule, LPT). ``flashattn-teach kernels --schedule`` simulates the three orders below
(:mod:`flashattn_teach.tools.kernels.waves`):

``INDEX``      the block fastest, in index order: head 0's blocks ``0 .. n_blocks - 1``, then head 1's.
``PER_HEAD``   the block fastest, each head's longest block first; the heads one after another.
``LONGEST``    longest first across the whole grid: all heads' longest blocks, then all heads' next ones.
               The heads run in groups of ``heads_per_group`` (the block rank fastest within a group, the
               groups one after another), so the programs in flight at once read the key/value (or, in
               dK/dV, query/dO) rows of a few heads that fit in L2 rather than of every head
               (FlashAttention-3's scheduler groups its heads in the same way).

``program_block`` maps a program id to ``(block, bh)``; :func:`flashattn_teach.masks.grid.grid_order` is its
Python mirror (with the same constants, which this package, importing nothing, keeps here as well), used by
the simulation and the replay page's GPU view; a test runs the two over the same small grids and compares the
constants. Without a causal mask every program does the same work: the kernels then take ``INDEX``, which
keeps one head's blocks together for L2. Under causal they take the launcher's ``GRID_ORDER``: ``PER_HEAD``
(the order a GPU ran on 2026-11-30) unless ``LONGEST`` is switched on (:mod:`flashattn_teach.triton.provenance`).
"""

from __future__ import annotations

import triton
from triton import language as tl

INDEX = tl.constexpr(0)
PER_HEAD = tl.constexpr(1)
LONGEST = tl.constexpr(2)
# The bytes of one head's reused operand (K and V rows, or Q and dO rows) that a group of heads may fill:
# a third of an H100/H200's 50 MiB L2, leaving room for the rows each program streams once.
L2_GROUP_BYTES = tl.constexpr(16 * 1024 * 1024)


@triton.jit
def _heads_per_group(n_rows, ROW_BYTES: tl.constexpr):
    """How many heads' reused rows (``n_rows`` rows of ``ROW_BYTES`` each) fit in ``L2_GROUP_BYTES``."""
    return tl.maximum(L2_GROUP_BYTES // (n_rows * ROW_BYTES), 1)


@triton.jit
def program_block(
    pid, n_blocks, n_bh, n_rows, ORDER: tl.constexpr, LONGEST_LAST: tl.constexpr, ROW_BYTES: tl.constexpr
):
    """``(block, bh)`` of program ``pid`` in a grid of ``n_blocks * n_bh`` programs.

    ``LONGEST_LAST``: the last block has the most work (forward and dQ under a causal mask); else the first
    has (dK/dV). ``n_rows`` and ``ROW_BYTES`` size the reused operand of one head for ``LONGEST``'s groups
    (keys and ``(D + D_v) * element size`` in forward and dQ; queries and the same in dK/dV)."""
    if ORDER == LONGEST:
        group = _heads_per_group(n_rows, ROW_BYTES)
        section = group * n_blocks  # the programs of one group of heads
        g = pid // section
        r = pid % section
        heads = tl.minimum(group, n_bh - g * group)  # the last group may be smaller
        rank = r // heads  # 0: the longest block
        bh = g * group + r % heads
    else:
        rank = pid % n_blocks
        bh = pid // n_blocks
    block = rank
    if ORDER != INDEX and LONGEST_LAST:
        block = n_blocks - 1 - rank
    return block, bh
