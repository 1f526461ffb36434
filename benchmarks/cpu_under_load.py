"""The default CPU path before and after the threaded backend, idle and with the second core busy.

    python benchmarks/cpu_under_load.py        # about 30 s on 2 cores

Times torch's CPU SDPA, ``backend="query_major"`` (the query-major loop, each op over all cores) and
``backend="parallel"`` (single-threaded ops on worker threads) on the forward at B=1, H=8, N=4096, D=64,
float32: the median of three calls after a warm-up, all in this process, first on an otherwise idle
machine, then while a child process spins (``while True: pass``). Prints one line per condition with each
time and its ratio to SDPA's. ``bench_cpu.py --targets`` measures the targets more carefully (paired,
alternating calls); this script shows the slowdown the threaded path removes.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import flashattn_teach as fa


def median_ms(fn: Callable[[], object], repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> int:
    q, k, v = (torch.randn(1, 8, 4096, 64) for _ in range(3))  # (B, H, N, D)
    for loaded in (False, True):
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if loaded else None
        try:
            time.sleep(0.5)
            sdpa = median_ms(lambda: F.scaled_dot_product_attention(q, k, v))
            online = median_ms(lambda: fa.flash_attention(q, k, v, backend="query_major"))
            parallel = median_ms(lambda: fa.flash_attention(q, k, v, backend="parallel"))
        finally:
            if spinner is not None:
                spinner.kill()
        print(
            f"{'loaded' if loaded else 'idle':>6}: sdpa {sdpa:.0f} ms, online {online:.0f} ms "
            f"({online / sdpa:.2f}x), parallel {parallel:.0f} ms ({parallel / sdpa:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
