"""How many bytes attention moves, and when that bounds its speed: HBM, the L2 cache, and a ring of devices.

    hbm      exact HBM traffic of standard and tiled attention, forward and backward (Dao et al. 2022,
             Theorems 2 and 5; Dao 2023), and the papers' FLOP convention
    l2       what the L2 cache saves the FA2 schedules when the programs running at once share re-reads
    ring     ring attention across devices (Liu et al. 2023): bytes per link per step against the FLOPs of
             a block, and the shard length above which the transfer hides
    command  ``flashattn-teach iomodel``

Pure Python (no torch), so the command and its tests run anywhere.
"""

from __future__ import annotations

from .command import add_arguments, run
from .hbm import (
    BACKWARD_FLOP_FACTOR,
    STAT_BYTES,
    Problem,
    Traffic,
    attention_flops,
    key_major_backward_io,
    key_major_forward_io,
    paper_block_sizes,
    query_major_forward_io,
    split_backward_io,
    split_backward_passes,
    standard_backward_io,
    standard_forward_io,
    theorem2_scale,
)
from .l2 import L2Cache, L2Figure, Residency, query_major_forward_l2, resident_heads, split_backward_l2
from .ring import RingHardware, RingStep, crossover_n_local, ring_step, shard_len, step_bytes, step_flops

__all__ = [
    "BACKWARD_FLOP_FACTOR",
    "STAT_BYTES",
    "L2Cache",
    "L2Figure",
    "Problem",
    "Residency",
    "RingHardware",
    "RingStep",
    "Traffic",
    "add_arguments",
    "attention_flops",
    "crossover_n_local",
    "key_major_backward_io",
    "key_major_forward_io",
    "paper_block_sizes",
    "query_major_forward_io",
    "query_major_forward_l2",
    "resident_heads",
    "ring_step",
    "run",
    "shard_len",
    "split_backward_io",
    "split_backward_l2",
    "split_backward_passes",
    "standard_backward_io",
    "standard_forward_io",
    "step_bytes",
    "step_flops",
    "theorem2_scale",
]
