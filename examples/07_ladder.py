"""The ladder from dense attention to the production Triton kernel: three rungs climbed by hand, then all five
by ``flashattn-teach ladder``, with what each rung costs and saves.

Each rung computes the same ``O`` from the same ``q, k, v (B, H, N, D)``: dense attention holds every score
``S = Q K^T`` at once; the query-major loop (FA2) and the key-major loop (FA1) hold one ``BLOCK_M x BLOCK_N``
tile of it and fold it in with the online softmax; the tutorial Triton kernel runs the query-major loop as
one program per query block; the production kernel is that with every variant. Without a GPU the kernels run
in Triton's interpreter, for correctness only (the command sets ``TRITON_INTERPRET=1`` itself).

Run: python examples/07_ladder.py [--n 113] [--causal]

Prints the by-hand differences, then the command's table (see ``flashattn-teach ladder --help``); exits 1
if a rung disagrees with float64 dense beyond the dtype's tolerance.
"""

from __future__ import annotations

import argparse

import torch

from flashattn_teach.cli import main as flashattn_teach
from flashattn_teach.core import dense, loops


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=113, help="sequence length (default 113: tiles end ragged)")
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()

    # By hand: the CPU rungs, called as a reader calls them. float32 inputs, float64 for the oracle.
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, args.n, 64) for _ in range(3))  # (B, H, N, D)
    O_dense, _ = dense.dense_attention(q, k, v, causal=args.causal)  # holds S: (1, 2, N, N)
    O_query, _ = loops.query_major_attention(q, k, v, causal=args.causal, block_m=32, block_n=32)
    O_key, _ = loops.key_major_attention(q, k, v, causal=args.causal, block_m=32, block_n=32)
    O_64, _ = dense.dense_attention(q.double(), k.double(), v.double(), causal=args.causal)
    by_hand = {
        "query-major - dense": max_diff(O_query, O_dense),
        "key-major - query-major": max_diff(O_key, O_query),
        "key-major - float64 dense": max_diff(O_key, O_64),
    }
    for name, diff in by_hand.items():
        print(f"by hand: max |{name}| = {diff:.1e}")
    if max(by_hand.values()) > 1e-5:
        raise SystemExit("by hand: a loop disagrees with dense beyond 1e-5")

    # All five rungs, with the scores each holds, the HBM bytes of its schedule and its time.
    print()
    status = flashattn_teach(["ladder", "--n", str(args.n), *(["--causal"] if args.causal else [])])
    raise SystemExit(status)


if __name__ == "__main__":
    main()
