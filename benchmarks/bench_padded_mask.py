"""A left-padded causal batch with the boolean mask a Hugging Face model builds, on the CPU: the drop-in
(which reads the mask tile by tile on the `parallel` path) against torch's SDPA and this library's dense
path. Best of 3 after one warm-up call; a one-off timing, not a CI gate.

Run: python benchmarks/bench_padded_mask.py
"""

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import flashattn_teach as fa

B, H, N, D = 2, 8, 2048, 64
PAD = (0, 600)  # left padding of each batch element


def best_of_3(f: Callable[[], object]) -> float:
    f()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D) for _ in range(3))
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    pad = torch.tensor(PAD)[:, None, None, None]
    mask = (j <= i) & (j >= pad)  # (B, 1, N, N): causal, and no padded key is visible
    print("path:", fa.explain(q, k, v, attn_mask=mask).backend)
    ours = best_of_3(lambda: fa.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    torch_sdpa = best_of_3(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    dense = best_of_3(lambda: fa.flash_attention(q, k, v, attn_mask=mask, backend="dense"))
    print(f"B={B} H={H} N={N} D={D}, left padding {PAD}, {torch.get_num_threads()} threads")
    print(f"drop-in {ours:.3f} s   torch SDPA {torch_sdpa:.3f} s   dense path {dense:.3f} s")


if __name__ == "__main__":
    main()
