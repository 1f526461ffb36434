"""The loop profile's estimates beside the measured TFLOP/s: what the model predicted for each pass and what
the benchmark timed, for the Triton rows.

    python benchmarks/estimates.py LOOPS_TXT ATTENTION_CSV [--seq-len 8192]

``LOOPS_TXT`` is the output of ``flashattn-teach kernels --loops`` (its ``# forward bfloat16 D=64 365 TFLOP/s
estimated`` lines, of non-causal loops); ``ATTENTION_CSV`` is benchmarks/bench_attention.py's. One line per
measured Triton row (every ``triton*`` provider) of the forward and backward passes, not causal, at the
given sequence length (default the longest the trimmed grid has, where a launch's tail matters least).
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

ESTIMATE = re.compile(r"# (forward|backward)\s+(\w+)\s+D=(\d+)\s+(\d+) TFLOP/s estimated")
PASSES = {"fwd": "forward", "bwd": "backward"}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def read_estimates(text: str) -> dict[tuple[str, str, int], int]:
    """``(pass, dtype, head dim) -> TFLOP/s`` from the loop profile's estimate lines."""
    return {(m[1], m[2], int(m[3])): int(m[4]) for m in map(ESTIMATE.match, text.splitlines()) if m}


def table(estimates: dict[tuple[str, str, int], int], rows: list[dict[str, str]], seq_len: int) -> list[str]:
    out = [f"{'pass':<9} {'dtype':<9} {'D':>4}  {'provider':<12} {'estimated':>9}  measured (TFLOP/s, N = {seq_len})"]
    for r in rows:
        name = PASSES.get(r["pass"])
        if name is None or not r["provider"].startswith("triton") or r["causal"] != "False":
            continue
        if int(r["seq_len"]) != seq_len:
            continue
        dtype = DTYPES.get(r["dtype"], r["dtype"])
        est = estimates.get((name, dtype, int(r["head_dim"])))
        got = f"{float(r['tflops']):.0f}" if r["status"] == "ok" else r["status"][:48]
        out.append(f"{name:<9} {dtype:<9} {r['head_dim']:>4}  {r['provider']:<12} {est or '-':>9}  {got}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("loops", type=Path)
    p.add_argument("attention_csv", type=Path)
    p.add_argument("--seq-len", type=int, default=8192)
    args = p.parse_args(argv)
    estimates = read_estimates(args.loops.read_text())
    with open(args.attention_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    print("\n".join(table(estimates, rows, args.seq_len)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
