"""What the L2 cache does to the FA2 schedules' HBM traffic: programs that run at once share their re-reads.

:mod:`.hbm` counts every load as an HBM access. Between the SMs and HBM sits an L2 cache that all SMs
share: 50 MiB on H100 and H200 (``cudaDevAttrL2CacheSize`` reports 52428800 bytes). The query-major forward
re-reads a head's ``K_j, V_j`` once per query block; when the query blocks of that head run at the same
time, the first read of a tile reaches HBM and the others hit in L2. That is why FA2-class kernels run
near the compute roof although the no-cache count puts them below the ridge point.

Which blocks run at the same time follows from the grid order. ``flashattn_teach.triton`` launches a
one-dimensional grid with the block index fastest, ``pid = (b H + h) T + i`` (``T`` blocks per head:
``T_r = ceil(N / BLOCK_M)`` query blocks, or ``T_c = ceil(N / BLOCK_N)`` key blocks in the dK/dV pass), and
the hardware starts programs in ``pid`` order as SMs free up. The ``P`` programs resident at once are then
a window of ``P`` consecutive ``pid``s, which touches at most

    heads resident = min(B H, 1 + ceil((P - 1) / T))

(batch, head) pairs: the worst window starts one program before a head boundary. Each pair re-reads a
working set, ``K, V`` (``2 N d e`` bytes) in the forward and the dQ pass, ``Q, dO, lse2, delta``
(``2 N d e + 8 N``) in the dK/dV pass, and the model is

    heads resident x working set of a head <= L2 size
        -> fits: the re-read tensors come from HBM once per (batch, head), their compulsory count;
    otherwise
        -> the count of :mod:`.hbm`, without reuse.

"Fits" is a sufficient condition: every re-read then finds its tile in L2 however far apart the programs
of a head have drifted. When it fails, programs that move in lockstep still share the tiles in flight, so
the truth lies between the two figures; the no-reuse count is the bound the model can vouch for, and it
offers no interpolation. Tensors that are not re-read (``Q, O, lse`` in the forward, every write) count
the same in both figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .hbm import STAT_BYTES, Problem, Traffic, query_major_forward_io, split_backward_passes

H100_L2_BYTES = 50 * 2**20  # H100/H200 SXM: 50 MiB of L2 (cudaDevAttrL2CacheSize = 52428800)
H100_SMS = 132  # H100/H200 SXM; one attention program per SM (a 128x64 hd128 tile takes most of its 228 KiB)


@dataclass(frozen=True)
class L2Cache:
    """An L2 of ``size_bytes`` shared by the ``programs`` programs resident at once."""

    size_bytes: float = H100_L2_BYTES
    programs: int = H100_SMS

    def __post_init__(self) -> None:
        if not self.size_bytes >= 0:  # also rejects nan
            raise ValueError(f"size_bytes must be >= 0, got {self.size_bytes}")
        if self.programs < 1:
            raise ValueError(f"programs must be >= 1, got {self.programs}")


@dataclass(frozen=True)
class Residency:
    """What the resident programs of one pass must keep in L2 for every re-read to hit."""

    pass_name: str
    reread: tuple[str, ...]  # the tensors each (batch, head) re-reads
    blocks_per_head: int  # T: programs per (batch, head)
    heads_resident: int
    head_bytes: int  # working set of one (batch, head): the re-read tensors, whole
    l2_bytes: float

    @property
    def resident_bytes(self) -> int:
        return self.heads_resident * self.head_bytes

    @property
    def fits(self) -> bool:
        return self.resident_bytes <= self.l2_bytes


@dataclass(frozen=True)
class L2Figure:
    """One schedule's HBM traffic without and with L2 reuse, and the residency of each of its passes."""

    without_l2: Traffic
    with_l2: Traffic
    passes: tuple[Residency, ...]

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.passes)


def resident_heads(programs: int, blocks_per_head: int, pairs: int) -> int:
    """Most (batch, head) pairs that a window of ``programs`` consecutive ``pid``s touches, when each pair
    owns ``blocks_per_head`` consecutive ``pid``s: ``min(pairs, 1 + ceil((programs - 1) / blocks_per_head))``."""
    if min(programs, blocks_per_head, pairs) < 1:
        raise ValueError(f"programs, blocks_per_head, pairs must be >= 1, got {programs, blocks_per_head, pairs}")
    return min(pairs, 1 + math.ceil((programs - 1) / blocks_per_head))


def _reuse(
    p: Problem, pass_name: str, t: Traffic, blocks_per_head: int, reread: dict[str, int], l2: L2Cache
) -> tuple[Traffic, Residency]:
    """``reread``: bytes of each re-read tensor for one (batch, head). Returns the pass's traffic with L2
    reuse (each of them read once per pair if the resident pairs' working sets fit) and its residency."""
    pairs = p.batch * p.heads
    residency = Residency(
        pass_name,
        tuple(reread),
        blocks_per_head,
        resident_heads(l2.programs, blocks_per_head, pairs),
        sum(reread.values()),
        l2.size_bytes,
    )
    if not residency.fits:
        return t, residency
    reads = {**t.reads, **{name: per_head * pairs for name, per_head in reread.items()}}
    return Traffic(reads, dict(t.writes)), residency


def query_major_forward_l2(p: Problem, block_m: int, block_n: int, l2: L2Cache) -> L2Figure:
    """FA2's forward: ``T_r = ceil(N / BLOCK_M)`` programs per head re-read ``K, V`` (``N d e`` bytes each)."""
    without = query_major_forward_io(p, block_m, block_n)
    kv = p.seq_len * p.head_dim * p.elem_bytes
    t_r = math.ceil(p.seq_len / block_m)
    with_l2, residency = _reuse(p, "forward", without, t_r, {"K": kv, "V": kv}, l2)
    return L2Figure(without, with_l2, (residency,))


def split_backward_l2(p: Problem, block_m: int, block_n: int, l2: L2Cache) -> L2Figure:
    """The split backward, pass by pass: the preprocess re-reads nothing; ``T_c = ceil(N / BLOCK_N)``
    dK/dV programs per head re-read ``Q, dO`` (``N d e`` bytes each) and ``lse2, delta`` (``4 N``);
    ``T_r`` dQ programs per head re-read ``K, V``."""
    passes = split_backward_passes(p, block_m, block_n)
    matrix, stat = p.seq_len * p.head_dim * p.elem_bytes, p.seq_len * STAT_BYTES
    t_r, t_c = math.ceil(p.seq_len / block_m), math.ceil(p.seq_len / block_n)
    dkdv, dkdv_res = _reuse(
        p, "backward dK/dV", passes["dK/dV"], t_c, {"Q": matrix, "dO": matrix, "lse2": stat, "delta": stat}, l2
    )
    dq, dq_res = _reuse(p, "backward dQ", passes["dQ"], t_r, {"K": matrix, "V": matrix}, l2)
    without = passes["preprocess"] + passes["dK/dV"] + passes["dQ"]
    return L2Figure(without, passes["preprocess"] + dkdv + dq, (dkdv_res, dq_res))
