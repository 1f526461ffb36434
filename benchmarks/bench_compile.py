"""Compiling a decode loop: graphs made and seconds taken, with the custom op and as torch ops.

A compiled decode step whose attention were traced through as Python would specialise on the cache lengths
and recompile as they grow (33 graphs and 60 s for this loop, before the op existed); with
``flashattn_teach::attention_with_kvcache`` (``ops_decode.py``) the lengths stay a tensor and one graph
serves every step. ``"traced"`` runs every step as a call that wants a gradient does instead
(``decode_traced.py``: torch ops over the whole cache, the lengths in the graph). This script compiles one step with
``torch.compile(dynamic=True)`` and runs ``--steps`` steps of a growing cache both ways, each in a fresh
process (torch's compile caches would otherwise carry over), and prints the graphs (``torch._dynamo``'s
frame count) and the wall time of the loop, compiling included.

    python benchmarks/bench_compile.py                     # inductor, 10 steps, B=2 H_q=4 H_kv=2 D=16
    python benchmarks/bench_compile.py --backend aot_eager

A one-off on the CPU; never a CI gate.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(mode: str, backend: str, steps: int) -> dict[str, object]:
    """One loop in this process: ``mode`` is ``"op"`` (the library as shipped) or ``"traced"`` (the path of
    calls that want a gradient)."""
    import torch
    import torch._dynamo.testing

    import flashattn_teach as fa
    from flashattn_teach.serving import ops as ops_decode

    if mode == "traced":
        ops_decode.traceable = lambda *tensors: False  # as if every call wanted a gradient
    B, H_q, H_kv, D, N_max = 2, 4, 2, 16, 64

    def step(q, k_cache, v_cache, k, v, lengths):
        return fa.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths)

    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(step, backend=counter, dynamic=True)
    k_cache, v_cache = torch.zeros(B, H_kv, N_max, D), torch.zeros(B, H_kv, N_max, D)
    lengths = torch.tensor([3, 7])
    start = time.perf_counter()
    for _ in range(steps):
        q, k, v = torch.randn(B, H_q, 1, D), torch.randn(B, H_kv, 1, D), torch.randn(B, H_kv, 1, D)
        compiled(q, k_cache, v_cache, k, v, lengths)
        lengths = lengths + 1
    return {"mode": mode, "graphs": counter.frame_count, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--worker", choices=("op", "traced"), help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker:
        print(json.dumps(worker(opts.worker, opts.backend, opts.steps)))
        return 0
    print(f"decode loop of {opts.steps} steps, torch.compile(dynamic=True, backend={opts.backend!r})")
    for mode in ("op", "traced"):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--backend", opts.backend,
               "--steps", str(opts.steps)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        print(f"{mode:>7}: {row['graphs']:>3} graphs  {row['seconds']:6.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
