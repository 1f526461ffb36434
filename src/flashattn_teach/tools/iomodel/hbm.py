"""How many bytes attention moves between HBM and the chip: standard versus tiled (FlashAttention's IO analysis).

Dao et al. 2022 ("FlashAttention", Theorem 2): for sequence length ``N``, head dimension ``d`` and on-chip
memory ``M`` elements with ``d <= M <= N d``, standard attention (the paper's Algorithm 0) makes
``Theta(N d + N^2)`` HBM accesses and FlashAttention (Algorithm 1) ``Theta(N^2 d^2 / M)``. Theorem 5 gives
the same two bounds for the backward (Algorithms 3 and 4).

The functions below count those accesses exactly, in bytes, for the schedules as written and as if every
load reached HBM (no cache in between; :mod:`.l2` adds one): ragged last blocks, key blocks wholly above
the causal diagonal skipped, per (batch, head) pair and then times ``B * H``. Matrices
``Q, K, V, O, dO, S, P, ...`` take ``elem_bytes`` per element; the per-row statistics ``l, m, lse, lse2,
delta`` are float32 (4 bytes), as in every implementation. Schedules:

    standard        Alg. 0 (forward) / Alg. 3 (backward): S, P (and dP, dS) go through HBM.
    key-major       FA1 Alg. 1 / Alg. 4: key blocks j outside; Q_i, O_i, l_i, m_i (and dO_i, dQ_i) are
                    re-read, and O_i, l_i, m_i (dQ_i) rewritten, once per visible key block.
    query-major     FA2's forward (Dao 2023, Alg. 1): query blocks i outside; K_j, V_j re-read once per
                    query block; O_i and lse_i written once.
    split           FA2-style backward as in Triton's tutorial and ``flashattn_teach.triton``: a preprocess
                    (delta = rowsum(dO * O), and lse2 = lse * log2(e) as FA3's), a dK/dV pass (key
                    blocks outside) and a dQ pass (query blocks outside), with no atomics.

FLOPs follow the papers' benchmark convention: ``4 B H N^2 d`` for the forward (two matmuls, two FLOPs
per multiply-add), halved when causal, and 2.5 times that for the backward (five matmuls instead of two).

What the L2 cache changes is in :mod:`.l2`; the ring across devices in :mod:`.ring`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

STAT_BYTES = 4  # l, m, lse, lse2, delta are float32 everywhere
BACKWARD_FLOP_FACTOR = 2.5  # backward: 5 matmuls of N^2 d against the forward's 2 (FA2 paper, Sec. 4)


@dataclass(frozen=True)
class Problem:
    """One attention call: ``B`` batches, ``H`` heads, self-attention over ``N`` tokens, head dim ``d``."""

    batch: int
    heads: int
    seq_len: int
    head_dim: int
    elem_bytes: int = 2
    causal: bool = False

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "seq_len", "head_dim", "elem_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Traffic:
    """HBM bytes read and written, per named tensor (already multiplied by ``B * H``)."""

    reads: dict[str, int] = field(default_factory=dict)
    writes: dict[str, int] = field(default_factory=dict)

    @property
    def read_bytes(self) -> int:
        return sum(self.reads.values())

    @property
    def write_bytes(self) -> int:
        return sum(self.writes.values())

    @property
    def total_bytes(self) -> int:
        return self.read_bytes + self.write_bytes

    def __add__(self, other: Traffic) -> Traffic:
        def merge(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
            return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}

        return Traffic(merge(self.reads, other.reads), merge(self.writes, other.writes))


def _scaled(p: Problem, reads: dict[str, int], writes: dict[str, int], stats: frozenset[str]) -> Traffic:
    """Element counts of one (batch, head) -> bytes over all ``B * H`` pairs."""
    bh = p.batch * p.heads

    def to_bytes(counts: dict[str, int]) -> dict[str, int]:
        return {k: n * bh * (STAT_BYTES if k in stats else p.elem_bytes) for k, n in counts.items()}

    return Traffic(to_bytes(reads), to_bytes(writes))


# ----------------------------------------------------------------------------------------------- FLOPs


def attention_flops(p: Problem, pass_: str = "forward") -> float:
    """FLOPs under the FlashAttention papers' convention: forward ``4 B H N^2 d``, halved if causal;
    backward 2.5x the forward; ``"forward+backward"`` 3.5x."""
    forward = 4.0 * p.batch * p.heads * p.seq_len**2 * p.head_dim
    if p.causal:
        forward /= 2
    factor = {"forward": 1.0, "backward": BACKWARD_FLOP_FACTOR, "forward+backward": 1.0 + BACKWARD_FLOP_FACTOR}
    if pass_ not in factor:
        raise ValueError(f"pass_ must be one of {sorted(factor)}, got {pass_!r}")
    return forward * factor[pass_]


# ------------------------------------------------------------------------------------- block geometry


def paper_block_sizes(sram_bytes: int, head_dim: int, elem_bytes: int = 2) -> tuple[int, int]:
    """FA1 Alg. 1 line 1: ``Bc = ceil(M / 4d)``, ``Br = min(ceil(M / 4d), d)``, with ``M`` in elements.

    Returns ``(block_m, block_n) = (Br, Bc)``."""
    m_elems = sram_bytes // elem_bytes
    if m_elems < head_dim:
        raise ValueError(f"on-chip memory of {m_elems} elements is below d = {head_dim}; Theorem 2 needs M >= d")
    bc = math.ceil(m_elems / (4 * head_dim))
    return min(bc, head_dim), bc


def _visible_key_rows(p: Problem, r1: int, block_n: int) -> int:
    """Key rows loaded for a query block ending at row ``r1`` (exclusive): every key block that holds at
    least one key ``c <= r1 - 1`` when causal (top-left = bottom-right for N_q = N_k), else all ``N``."""
    if not p.causal:
        return p.seq_len
    return min(p.seq_len, math.ceil(r1 / block_n) * block_n)


def _visible_query_rows(p: Problem, c0: int, block_m: int) -> int:
    """Query rows loaded for a key block starting at ``c0``: every query block holding a row ``r >= c0``."""
    if not p.causal:
        return p.seq_len
    return p.seq_len - (c0 - c0 % block_m)


def _sum_key_rows(p: Problem, block_m: int, block_n: int) -> int:
    """Sum over query blocks i of the key rows that block i reads."""
    return sum(_visible_key_rows(p, min(r0 + block_m, p.seq_len), block_n) for r0 in range(0, p.seq_len, block_m))


def _sum_query_rows(p: Problem, block_m: int, block_n: int) -> int:
    """Sum over key blocks j of the query rows that block j reads."""
    return sum(_visible_query_rows(p, c0, block_m) for c0 in range(0, p.seq_len, block_n))


def _check_blocks(block_m: int, block_n: int) -> None:
    if block_m < 1 or block_n < 1:
        raise ValueError(f"block sizes must be >= 1, got {block_m} x {block_n}")


# ------------------------------------------------------------------------------------------- forward


def standard_forward_io(p: Problem) -> Traffic:
    """Alg. 0: ``S = Q K^T`` written to HBM, read back for ``P = softmax(S)``, ``P`` written and read for
    ``O = P V``. ``4 N^2 + 4 N d`` elements: ``Theta(N d + N^2)``. Causal masking still stores all of S."""
    N, d = p.seq_len, p.head_dim
    reads = {"Q": N * d, "K": N * d, "S": N * N, "P": N * N, "V": N * d}
    writes = {"S": N * N, "P": N * N, "O": N * d}
    return _scaled(p, reads, writes, frozenset())


def key_major_forward_io(p: Problem, block_m: int, block_n: int) -> Traffic:
    """FA1 Alg. 1: ``K_j, V_j`` read once (line 6); for every visible tile, ``Q_i, O_i, l_i, m_i`` read
    (line 8) and ``O_i, l_i, m_i`` written (lines 12-13); ``O, l, m`` initialised in HBM (line 2)."""
    _check_blocks(block_m, block_n)
    N, d = p.seq_len, p.head_dim
    rows = _sum_query_rows(p, block_m, block_n)
    reads = {"K": N * d, "V": N * d, "Q": rows * d, "O": rows * d, "l": rows, "m": rows}
    writes = {"O": N * d + rows * d, "l": N + rows, "m": N + rows}
    return _scaled(p, reads, writes, frozenset({"l", "m"}))


def query_major_forward_io(p: Problem, block_m: int, block_n: int) -> Traffic:
    """FA2 Alg. 1: ``Q_i`` read once; ``K_j, V_j`` read once per query block that sees them; ``O_i`` and
    ``lse_i`` written once."""
    _check_blocks(block_m, block_n)
    N, d = p.seq_len, p.head_dim
    key_rows = _sum_key_rows(p, block_m, block_n)
    reads = {"Q": N * d, "K": key_rows * d, "V": key_rows * d}
    writes = {"O": N * d, "lse": N}
    return _scaled(p, reads, writes, frozenset({"lse"}))


# ------------------------------------------------------------------------------------------ backward


def standard_backward_io(p: Problem) -> Traffic:
    """Alg. 3: ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - rowsum(dP * P))``, ``dQ = dS K``,
    ``dK = dS^T Q``, with ``P, dP, dS`` through HBM. ``7 N^2 + 8 N d`` elements: ``Theta(N d + N^2)``."""
    N, d = p.seq_len, p.head_dim
    reads = {"P": 2 * N * N, "dO": 2 * N * d, "V": N * d, "dP": N * N, "dS": 2 * N * N, "K": N * d, "Q": N * d}
    writes = {"dV": N * d, "dP": N * N, "dS": N * N, "dQ": N * d, "dK": N * d}
    return _scaled(p, reads, writes, frozenset())


def key_major_backward_io(p: Problem, block_m: int, block_n: int) -> Traffic:
    """FA1 Alg. 4: ``dQ`` zeroed in HBM (line 5); ``K_j, V_j`` read once (line 7); for every visible tile
    ``Q_i, O_i, dO_i, dQ_i, l_i, m_i`` read (line 10) and ``dQ_i`` written (line 21); ``dK_j, dV_j``
    written once (line 24)."""
    _check_blocks(block_m, block_n)
    N, d = p.seq_len, p.head_dim
    rows = _sum_query_rows(p, block_m, block_n)
    reads = {"K": N * d, "V": N * d, "Q": rows * d, "O": rows * d, "dO": rows * d, "dQ": rows * d, "l": rows, "m": rows}
    writes = {"dQ": N * d + rows * d, "dK": N * d, "dV": N * d}
    return _scaled(p, reads, writes, frozenset({"l", "m"}))


def split_backward_io(p: Problem, block_m: int, block_n: int) -> Traffic:
    """FA2-style backward in three kernels, as in Triton's fused-attention tutorial: the sum of
    :func:`split_backward_passes`."""
    passes = split_backward_passes(p, block_m, block_n)
    return passes["preprocess"] + passes["dK/dV"] + passes["dQ"]


def split_backward_passes(p: Problem, block_m: int, block_n: int) -> dict[str, Traffic]:
    """The three kernels of the split backward, by name: ``"preprocess"`` reads ``O, dO, lse`` and writes
    ``delta`` and ``lse2 = lse * log2(e)``; ``"dK/dV"`` reads ``K_j, V_j`` once and ``Q_i, dO_i, lse2_i,
    delta_i`` per visible tile, writing ``dK_j, dV_j`` once; ``"dQ"`` reads ``Q_i, dO_i, lse2_i, delta_i``
    once and ``K_j, V_j`` per visible tile, writing ``dQ_i`` once."""
    _check_blocks(block_m, block_n)
    N, d = p.seq_len, p.head_dim
    q_rows = _sum_query_rows(p, block_m, block_n)  # dK/dV pass: key blocks outside
    k_rows = _sum_key_rows(p, block_m, block_n)  # dQ pass: query blocks outside
    stats = frozenset({"lse", "lse2", "delta"})
    preprocess = _scaled(p, {"O": N * d, "dO": N * d, "lse": N}, {"delta": N, "lse2": N}, stats)
    dkdv = _scaled(
        p,
        {"K": N * d, "V": N * d, "Q": q_rows * d, "dO": q_rows * d, "lse2": q_rows, "delta": q_rows},
        {"dK": N * d, "dV": N * d},
        stats,
    )
    dq = _scaled(
        p, {"Q": N * d, "dO": N * d, "lse2": N, "delta": N, "K": k_rows * d, "V": k_rows * d}, {"dQ": N * d}, stats
    )
    return {"preprocess": preprocess, "dK/dV": dkdv, "dQ": dq}


def theorem2_scale(p: Problem, sram_bytes: int) -> float:
    """``B H N^2 d^2 / M`` in bytes (``M`` in elements): the order of the tiled algorithm's traffic."""
    m_elems = sram_bytes / p.elem_bytes
    return p.batch * p.heads * p.seq_len**2 * p.head_dim**2 / m_elems * p.elem_bytes
