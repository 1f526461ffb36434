"""The block-mask classifications the GPU tests launch, as data: ``tests/flex/test_block_mask_triton.py``'s
GPU test runs ``create_block_mask(fn, B, H, 1000, 777, device="cuda", BLOCK_SIZE=(64, 32))`` for each of its
translated ``mask_mod`` functions, which on CUDA launches the block-kinds kernel with the function translated to
``@triton.jit`` (:func:`flashattn_teach.triton.block_mask.triton_block_kinds`). Each function is a
specialisation of its own (its translation is a constant of the kernel), so each is here, written as the test
writes it. (The score_mod calls of the first light are :data:`.cases.FIRST_LIGHT_SCORE_MODS`.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

N_Q, N_K, BLOCK = 1000, 777, (64, 32)
# (2, 203) document ids, different per batch element (the test's DOC)
DOC = torch.repeat_interleave(torch.arange(8), torch.tensor([30, 1, 60, 40, 72, 0, 0, 0])).view(1, 203)
DOC = torch.cat([DOC, DOC.flip(1)])


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 48)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < 40) | (q_idx >= kv_idx)


def dilated_window(b, h, q_idx, kv_idx):
    return ((q_idx - kv_idx) % 2 == 0) & (q_idx >= kv_idx) & (q_idx - kv_idx <= 96)


def head_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 16 * (h + 1))


def document(b, h, q_idx, kv_idx):
    return DOC[b, q_idx] == DOC[b, kv_idx]


@dataclass(frozen=True)
class BlockMaskCall:
    """One ``create_block_mask(mask_mod, B, H, N_Q, N_K, device="cuda", BLOCK_SIZE=BLOCK)``."""

    name: str
    mask_mod: Callable[..., torch.Tensor]
    B: int
    H: int


BLOCK_MASK_CALLS = [
    BlockMaskCall(f"tests-block-mask-{fn.__name__}", fn, B, H)
    for fn, B, H in (
        (causal, 1, 1),
        (sliding_window, 1, 1),
        (prefix_lm, 2, 2),
        (dilated_window, 1, 1),
        (head_window, 2, 3),
        (document, 2, 3),
    )
]
