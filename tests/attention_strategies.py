"""Hypothesis strategies for attention problems, shared by the test files."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from flashattn_teach._options import make_options
from flashattn_teach.reference import parallel
from flashattn_teach.reference.online import tiled_attention

LENGTHS = st.one_of(st.integers(1, 17), st.sampled_from([1, 2, 3, 5, 7, 13, 31, 37]))
HEAD_DIMS = st.one_of(st.integers(1, 9), st.sampled_from([1, 3, 5, 16]))
BLOCKS = st.one_of(st.integers(1, 8), st.sampled_from([1, 3, 5, 16, 64]))


@dataclass
class Problem:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    causal_align: str
    block_m: int
    block_n: int

    @property
    def kwargs(self) -> dict:
        return dict(causal=self.causal, causal_align=self.causal_align, enable_gqa=True)

    @property
    def tiles(self) -> dict:
        return dict(block_m=self.block_m, block_n=self.block_n)


@st.composite
def problems(draw, dtype=torch.float64, max_batch: int = 2, requires_grad: bool = False) -> Problem:
    """Random batch/heads/lengths (N = 1, primes, N_q != N_k), head dims (1, odd), GQA/MQA, tilings."""
    B = draw(st.integers(1, max_batch))
    H_kv = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 1, 2, 3]))  # query heads per key/value head
    N_q, N_k = draw(LENGTHS), draw(LENGTHS)
    D, D_v = draw(HEAD_DIMS), draw(HEAD_DIMS)
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)

    def make(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(requires_grad)

    return Problem(
        q=make(B, H_kv * G, N_q, D),
        k=make(B, H_kv, N_k, D),
        v=make(B, H_kv, N_k, D_v),
        causal=draw(st.booleans()),
        causal_align=draw(st.sampled_from(["top_left", "bottom_right"])),
        block_m=draw(BLOCKS),
        block_n=draw(BLOCKS),
    )


def parallel_attention(q, k, v, *, block_m, block_n, return_lse=False, **kwargs):
    """The parallel path with chosen tiles, its forward spread over the pool even for a small problem."""
    opts = make_options(q, k, v, **kwargs)
    smallest, parallel.MIN_PARALLEL_SCORES = parallel.MIN_PARALLEL_SCORES, 0
    try:
        O, lse = tiled_attention(q, k, v, opts, order="parallel", block_m=block_m, block_n=block_n)
    finally:
        parallel.MIN_PARALLEL_SCORES = smallest
    return (O, lse) if return_lse else O
