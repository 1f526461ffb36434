"""``flashattn-teach demo``: the teaching example's run, then what the tiles buy and cost."""

from __future__ import annotations

import argparse

import torch

from ._cli_types import seed
from .reference import dense_attention, online_attention
from .schedules import AttentionSchedules


def seed_inputs(seed: int = 0, shape: tuple[int, ...] = (1, 6, 4), dtype: torch.dtype = torch.float32):
    """The example's inputs: ``torch.manual_seed(seed)`` then three ``randn`` calls, in the order q, k, v."""
    torch.manual_seed(seed)
    return tuple(torch.randn(*shape, dtype=dtype) for _ in range(3))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=seed, default=0, help="torch.manual_seed for the inputs (default 0)")


NEXT = (  # (what it shows, the command)
    ("the tile replay page, one tile update at a time", "flashattn-teach replay --format html --out replay.html"),
    ("the ladder from dense attention to the Triton kernel, each rung checked", "flashattn-teach ladder"),
)


def run(args: argparse.Namespace) -> int:
    q, k, v = seed_inputs(args.seed)
    _, N, D = q.shape  # (B, N, D)
    model = AttentionSchedules().eval()
    with torch.no_grad():
        out = model(q, k, v)  # (2, B, N, D): [dense, tiled]
    print(f"inputs q, k, v: (B, N, D) = {tuple(q.shape)}, float32, torch.manual_seed({args.seed})")
    print(f"AttentionSchedules output [dense, tiled]: shape {list(out.shape)}")
    print(f"max |dense - tiled| with 2 x 2 tiles: {(out[0] - out[1]).abs().max().item():.3e}")
    print(f"\nscores held at once per (batch, head): dense N x N = {N * N}, tiled 2 x 2 = {2 * 2}")
    print("\nmax |online_attention - float64 dense| per tile size (block_m x block_n):")
    oracle = dense_attention(q.double(), k.double(), v.double())
    for bm, bn in [(1, 1), (2, 2), (4, 4), (3, 5), (6, 6)]:
        err = (online_attention(q, k, v, block_m=bm, block_n=bn).double() - oracle).abs().max().item()
        print(f"  tiles {bm} x {bn}: max error {err:.3e}")
    # Large logits: stretch q and k until the largest score is 1e4, where a naive exp() overflows.
    S = q @ k.mT / D**0.5  # (B, N, D) @ (B, D, N) -> (B, N, N)
    c = (1e4 / S.abs().max()).sqrt()
    o_big = online_attention(q * c, k * c, v, block_m=2, block_n=2)
    err = (o_big.double() - dense_attention(q.double() * c, k.double() * c, v.double())).abs().max().item()
    finite = bool(torch.isfinite(o_big).all())
    print(f"\nlarge logits, max |S| = 1e4 (exp(S) overflows): finite={finite}, max error {err:.3e}")
    print("\nnext:")
    for what, command in NEXT:
        print(f"  {what}:\n    {command}")
    return 0
