"""The teaching example's module: dense and tiled attention side by side.

``AttentionSchedules()(q, k, v)`` returns ``torch.stack([dense(q, k, v), tiled(q, k, v)])``, so the two
schedules of the same exact attention can be compared element by element.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .reference import dense_attention, online_attention


class DenseAttention(nn.Module):
    """``softmax(scale * q k^T) v`` with every score materialised."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return dense_attention(q, k, v)


class TiledAttention(nn.Module):
    """Query-major online softmax over ``block_m x block_n`` tiles (2 x 2 in the teaching example)."""

    def __init__(self, block_m: int = 2, block_n: int = 2) -> None:
        super().__init__()
        self.block_m = block_m
        self.block_n = block_n

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return online_attention(q, k, v, block_m=self.block_m, block_n=self.block_n)

    def extra_repr(self) -> str:
        return f"block_m={self.block_m}, block_n={self.block_n}"


class AttentionSchedules(nn.Module):
    """Both schedules of one attention: ``(..., N, D)`` inputs -> ``(2, ..., N, D_v)`` output."""

    def __init__(self, block_m: int = 2, block_n: int = 2) -> None:
        super().__init__()
        self.dense = DenseAttention()
        self.tiled = TiledAttention(block_m, block_n)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return torch.stack([self.dense(q, k, v), self.tiled(q, k, v)])
