"""Ring attention (context parallelism): exact attention over a sequence sharded across processes.

Public API:
    ring_attention     call on every rank with its shards; differentiable
    shard, unshard     split a full sequence into a layout's shards, and back
    chunk_ids          the chunks of the sequence a rank holds
    ring_schedule      which (query chunk, key chunk) blocks each rank computes at each ring step
    visited_tiles      the tiles each rank's backend visits, from that schedule
    picture            the schedule as text: which rank computes each chunk pair, at which step
    RingStats          what one rank's ring actually ran
    RingTimeoutError   a rank failed or never arrived
    RingMismatchError  the ranks passed different shapes, dtypes or options

Papers: Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context"
(arXiv:2310.01889); Brandon et al. 2023, "Striped Attention: Faster Ring Attention for Causal
Transformers" (arXiv:2311.09431). The zigzag layout is the load-balanced variant of ring-flash-attention
and of Llama 3's context parallelism.
"""

from .comm import RingMismatchError, RingTimeoutError
from .layout import LAYOUTS, chunk_ids, picture, ring_schedule, shard, unshard, visited_tiles
from .ring import DEFAULT_TIMEOUT, RingStats, ring_attention

__all__ = [
    "DEFAULT_TIMEOUT",
    "LAYOUTS",
    "RingMismatchError",
    "RingStats",
    "RingTimeoutError",
    "chunk_ids",
    "picture",
    "ring_attention",
    "ring_schedule",
    "shard",
    "unshard",
    "visited_tiles",
]
