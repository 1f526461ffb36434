"""The ring (context parallelism): when does passing K/V shards between devices hide behind the attention?

Liu et al. 2023 ("Ring Attention with Blockwise Transformers"): a sequence of ``N`` tokens is split over
``W`` devices, device ``r`` holding ``N_local = N / W`` queries and one shard of the keys and values. In
step ``s = 0 .. W-1`` it computes the attention of its queries to the shard it holds (its own at ``s = 0``,
device ``r - s``'s after that) and folds the result into its output with the log-sum-exp merge, while it
sends that shard on to device ``r + 1`` and receives the next one from ``r - 1``. Each device sends one
shard per step, so each link of the ring carries, per step,

    bytes  = t N_local d e H_kv B     t = 2 (K, V) forward; 4 backward, where dK, dV travel with K, V
                                      (ring-flash-attention's scheme), in the same e bytes per element

against the device's work on one block,

    FLOPs  = c 4 B H N_local^2 d      c = 1 forward, 2.5 backward (the papers' convention), x 1/2 causal.

The causal 1/2 holds at every step only in the zigzag layout (Brandon et al. 2023; ring-flash-attention):
device ``r`` holds chunks ``r`` and ``2W-1-r`` of ``2W``. At ``s > 0`` a shard from an earlier device
``r' < r`` is seen whole by all ``N_local`` queries through its first half and not at all through its
second, one from a later device ``r' > r`` by only the second half of the queries, both ``N_local^2 / 2``
pairs; at ``s = 0`` the two diagonal chunks are half visible and the cross chunk whole, ``2 (N_local/2)^2``.
In the contiguous layout the work of a step is 0, a triangle or a full block, and the slowest device sets
the pace. Non-causal attention does the full block at every step in either layout.

The transfer hides when it takes no longer than the block's attention. With link bandwidth ``BW``
(bytes/s, one direction) and throughput ``F`` (FLOP/s achieved):

    t N_local d e H_kv B / BW  <=  c 4 B H N_local^2 d / F
    <=>  N_local  >=  N_local* = t e H_kv F / (4 c H BW)

``B`` and ``d`` cancel: a step's FLOPs per byte sent, ``4 c H N_local / (t e H_kv)``, grows with the shard
because each key meets ``N_local`` queries, and must reach the link's ridge point ``F / BW``. Forward,
bf16, ``H_kv = H``: ``N_local* = F / BW``, about 1100 tokens for 989 TFLOP/s x 0.5 over 450 GB/s. The
backward sends twice the bytes for 2.5 times the work: ``N_local*`` is 0.8 times the forward's. Causal
doubles both. Left out: each message's latency (microseconds, which matters when a step is that short),
other traffic on the same links, and the last step of the backward that returns dK, dV to their owner.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hbm import BACKWARD_FLOP_FACTOR, Problem

NVLINK4_GBS = 450.0  # H100/H200 SXM: 18 NVLink 4 links x 25 GB/s = 450 GB/s per direction (900 bidirectional)
H200_BF16_TFLOPS = 989.0  # dense bf16 tensor-core peak, H100/H200 SXM datasheets
ACHIEVED = 0.5  # this project's Triton forward on an H200: 505 TFLOP/s at d = 128, N = 8192 (README)
SHARDS_SENT = {"forward": 2, "backward": 4}  # t: K, V; and dK, dV in the backward
FLOP_FACTOR = {"forward": 1.0, "backward": BACKWARD_FLOP_FACTOR}  # c


@dataclass(frozen=True)
class RingHardware:
    """A link of ``link_gbs`` GB/s per direction and devices that run ``efficiency x peak_tflops``."""

    link_gbs: float = NVLINK4_GBS
    peak_tflops: float = H200_BF16_TFLOPS
    efficiency: float = ACHIEVED

    def __post_init__(self) -> None:
        if not (self.link_gbs > 0 and self.peak_tflops > 0):
            raise ValueError(f"link_gbs and peak_tflops must be > 0, got {self.link_gbs}, {self.peak_tflops}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {self.efficiency}")

    @property
    def bandwidth(self) -> float:
        """BW, bytes/s."""
        return self.link_gbs * 1e9

    @property
    def throughput(self) -> float:
        """F, FLOP/s achieved."""
        return self.peak_tflops * 1e12 * self.efficiency


def kv_heads_of(p: Problem, kv_heads: int | None) -> int:
    """``H_kv``: ``p.heads`` when ``None``; with GQA, a divisor of ``H``."""
    if kv_heads is None:
        return p.heads
    if kv_heads < 1 or p.heads % kv_heads:
        raise ValueError(f"must divide the {p.heads} query heads (GQA), got {kv_heads}")
    return kv_heads


def shard_len(p: Problem, world: int) -> int:
    """``N_local = N / W``; causal shards are two chunks of the zigzag layout, so ``2W`` must divide ``N``."""
    if world < 2:
        raise ValueError(f"a ring needs at least 2 devices, got {world}")
    chunks = 2 * world if p.causal else world
    if p.seq_len % chunks:
        layout = f"2W = {chunks} zigzag chunks" if p.causal else f"W = {world} devices"
        raise ValueError(f"N = {p.seq_len} does not split into {layout}")
    return p.seq_len // world


def _check_pass(pass_: str) -> None:
    if pass_ not in SHARDS_SENT:
        raise ValueError(f"pass_ must be one of {sorted(SHARDS_SENT)}, got {pass_!r}")


def step_bytes(p: Problem, n_local: float, pass_: str = "forward", kv_heads: int | None = None) -> float:
    """Bytes one device sends per step: ``t N_local d e H_kv B``."""
    _check_pass(pass_)
    return SHARDS_SENT[pass_] * n_local * p.head_dim * p.elem_bytes * kv_heads_of(p, kv_heads) * p.batch


def step_flops(p: Problem, n_local: float, pass_: str = "forward") -> float:
    """FLOPs of one device's block per step: ``c 4 B H N_local^2 d``, halved if causal (zigzag layout)."""
    _check_pass(pass_)
    causal = 0.5 if p.causal else 1.0
    return FLOP_FACTOR[pass_] * 4.0 * p.batch * p.heads * n_local**2 * p.head_dim * causal


def crossover_n_local(p: Problem, hw: RingHardware, pass_: str = "forward", kv_heads: int | None = None) -> float:
    """``N_local* = t e H_kv F / (4 c H BW)``, doubled if causal: the shard length at which a step's
    transfer takes as long as its attention."""
    _check_pass(pass_)
    causal = 0.5 if p.causal else 1.0
    t, c = SHARDS_SENT[pass_], FLOP_FACTOR[pass_] * causal
    return t * p.elem_bytes * kv_heads_of(p, kv_heads) * hw.throughput / (4 * c * p.heads * hw.bandwidth)


@dataclass(frozen=True)
class RingStep:
    """One step of the ring on one device: what it sends, what it computes, and how long each takes."""

    pass_: str
    world: int
    n_local: int
    bytes: float
    flops: float
    comm_s: float
    compute_s: float
    crossover_n_local: float

    @property
    def hides(self) -> bool:
        """The transfer of the next shard takes no longer than this block's attention."""
        return self.comm_s <= self.compute_s


def ring_step(
    p: Problem, world: int, hw: RingHardware, pass_: str = "forward", kv_heads: int | None = None
) -> RingStep:
    """A step of the ring over ``world`` devices for the whole sequence ``p``."""
    n_local = shard_len(p, world)
    sent, flops = step_bytes(p, n_local, pass_, kv_heads), step_flops(p, n_local, pass_)
    return RingStep(
        pass_,
        world,
        n_local,
        sent,
        flops,
        sent / hw.bandwidth,
        flops / hw.throughput,
        crossover_n_local(p, hw, pass_, kv_heads),
    )
