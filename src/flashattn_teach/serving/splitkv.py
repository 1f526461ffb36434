"""Split-KV (Flash-Decoding): how many key ranges a decode step is cut into, and where they fall.

A decode step has few query rows (``N_new``, often 1) against a long cache, so one program per
``(batch, key/value head)`` leaves most of a GPU idle. Flash-Decoding (Dao, Haziza, Massa, Sizov 2023,
"Flash-Decoding for long-context inference") also cuts the keys into ``num_splits`` contiguous ranges,
runs ``B x H_kv x num_splits`` programs, each giving a partial ``(O_s, lse_s)`` over its range, and merges
the partials exactly (``merge.py``).

The number of splits (flash-attn's ``num_splits_heuristic``, ``csrc/flash_attn/flash_api.cpp``): with
``P = B x H_kv x m_blocks`` programs per split and ``S`` streaming multiprocessors, ``s`` splits run in
``P s / S`` waves, and the last wave is only partly full::

    efficiency(s) = waves / ceil(waves),   waves = P s / S

One split when ``P`` already nearly fills the GPU (``P >= 0.8 S``); otherwise the smallest ``s`` whose
efficiency is within 85% of the best, among the ``s`` that change the keys per split (with 64 key blocks,
11 and 12 splits both give 6 blocks per split, so 12 is not eligible) and at most ``min(128, S, n_blocks)``
(more splits than key blocks leave programs with nothing to do; every split costs a partial result's
write and read). flash-attn counts its kernel's programs on twice the SMs (two blocks per SM).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# flash-attn's decode kernel tiles: 64 query rows per program, and keys per block by head dimension.
DECODE_BLOCK_M = 64
MAX_SPLITS = 128
FILL_FRACTION = 0.8  # P >= 0.8 S: the GPU is nearly full without splitting
NEAR_BEST = 0.85  # take the fewest splits within 85% of the best wave efficiency


def decode_block_n(D: int) -> int:
    """flash-attn's key block of its split-KV kernel: 256 keys for ``D <= 64``, 128 up to 128, else 64."""
    return 256 if D <= 64 else 128 if D <= 128 else 64


def num_splits_heuristic(programs: int, sm_slots: int, n_blocks: int, max_splits: int = MAX_SPLITS) -> int:
    """The number of splits that best fills ``sm_slots`` with ``programs x splits`` programs (module docs)."""
    if programs >= FILL_FRACTION * sm_slots:
        return 1
    max_splits = min(max_splits, sm_slots, n_blocks)

    def eligible(s: int) -> bool:
        return s == 1 or math.ceil(n_blocks / s) != math.ceil(n_blocks / (s - 1))

    def efficiency(s: int) -> float:
        waves = programs * s / sm_slots
        return waves / math.ceil(waves)

    candidates = [s for s in range(1, max_splits + 1) if eligible(s)]
    if not candidates:
        return 1
    best = max(efficiency(s) for s in candidates)
    return next(s for s in candidates if efficiency(s) >= NEAR_BEST * best)


def cuda_num_splits(*, B: int, H_kv: int, N_q: int, group: int, N_k: int, D: int, sm_count: int) -> int:
    """Splits for a decode step on a GPU with ``sm_count`` SMs: the ``G`` query heads of a key/value head
    share its program (their ``G x N_q`` rows are one query block, as flash-attn runs a decode step with
    grouped heads), so there are ``B x H_kv x ceil(G N_q / 64)`` programs per split."""
    m_blocks = max(1, math.ceil(group * N_q / DECODE_BLOCK_M))
    n_blocks = max(1, math.ceil(N_k / decode_block_n(D)))
    return num_splits_heuristic(B * H_kv * m_blocks, 2 * sm_count, n_blocks)


def split_ranges(L: int, num_splits: int) -> list[tuple[int, int]]:
    """``num_splits`` contiguous ranges cutting keys ``[0, L)``: ``ceil(L / num_splits)`` keys each, the last
    ones short or empty (``(L, L)``) when the keys do not divide evenly or there are fewer keys than splits."""
    if num_splits == 1:  # the CPU paths' default: no arithmetic to do
        return [(0, L)]
    size = math.ceil(L / num_splits) if L else 0
    return [(min(s * size, L), min((s + 1) * size, L)) for s in range(num_splits)]


def default_num_splits(q: Tensor, k_cache: Tensor, L_max: int) -> int:
    """``num_splits=0``: on CUDA, :func:`cuda_num_splits` for the GPU's SM count and the longest key range
    ``L_max`` (the Triton decode path passes the caches' capacity ``N_max``, as flash-attn does, since its
    lengths stay on the device); on the CPU 1 (its paths run the ranges one after another, so more would
    only add merges)."""
    if not q.is_cuda:
        return 1
    B, H_q, N_q, D = q.shape
    H_kv = k_cache.shape[1]
    sm_count = torch.cuda.get_device_properties(q.device).multi_processor_count
    return cuda_num_splits(B=B, H_kv=H_kv, N_q=N_q, group=H_q // H_kv, N_k=L_max, D=D, sm_count=sm_count)
