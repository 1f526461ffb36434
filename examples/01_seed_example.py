"""Reproduce the teaching example: dense and tiled attention on three [1, 6, 4] inputs.

Run: python examples/01_seed_example.py
"""

import torch

from flashattn_teach import AttentionSchedules


def main() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 6, 4) for _ in range(3))  # (batch 1, six tokens, width four), float32
    model = AttentionSchedules(block_m=2, block_n=2).eval()
    with torch.no_grad():
        out = model(q, k, v)  # (2, 1, 6, 4): [dense, tiled]
    print("output shape:", list(out.shape))
    print(f"max |dense - tiled|: {(out[0] - out[1]).abs().max().item():.3e}")


if __name__ == "__main__":
    main()
