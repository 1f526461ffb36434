"""The loop profile's estimates beside the measured TFLOP/s: what the model predicted for each pass, what it
rests on, and what the benchmark timed, for the Triton rows.

    python benchmarks/estimates.py LOOPS_TXT ATTENTION_CSV [--seq-len 8192]

``LOOPS_TXT`` is the output of ``flashattn-teach kernels --loops`` (its ``# forward bfloat16 D=64 365 TFLOP/s
estimated, ...`` lines, of non-causal loops); ``ATTENTION_CSV`` is benchmarks/bench_attention.py's. One line per
measured Triton row (every ``triton*`` provider) of the forward and backward passes, not causal, at the
given sequence length (default the longest the trimmed grid has, where a launch's tail matters least).

Each estimate carries its basis: ``calibrated`` (the model's factor was fitted on kernels of the same kind,
named in the footer) or ``uncalibrated`` (a warp-specialised kernel: the factor is borrowed). The forward
estimate stands beside the default forward only (``triton``, ``triton-det``), not beside ``triton-ptr`` or
``triton-nows``, which run other kernels; the backward's beside the backward that provider runs: two kernels
for ``triton-det``, the one-kernel backward (dQ by atomics) where the loop profile has one, otherwise two.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

ESTIMATE = re.compile(r"# (forward|backward)\s+(\w+)\s+D=(\d+)\s+(\d+) TFLOP/s estimated(.*)$")
PASSES = {"fwd": "forward", "bwd": "backward"}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
DEFAULT_FORWARD = ("triton", "triton-det")  # the providers whose forward is the profiled one


def read_estimates(text: str) -> dict[tuple[str, str, int, str], tuple[int, str]]:
    """``(pass, dtype, head dim, kernels) -> (TFLOP/s, what it rests on)`` from the loop profile's estimate
    lines; ``kernels`` is ``forward``, ``two kernels`` or ``one kernel`` (the backward's forms)."""
    out = {}
    for m in map(ESTIMATE.match, text.splitlines()):
        if m is None:
            continue
        rest = m[5].lstrip(", ").strip()
        kernels = "forward" if m[1] == "forward" else "one kernel" if "one kernel" in rest else "two kernels"
        out[(m[1], m[2], int(m[3]), kernels)] = (int(m[4]), rest or "calibrated (no basis printed)")
    return out


def label(basis: str) -> str:
    return "uncalibrated" if "uncalibrated" in basis else "calibrated"


def estimate_for(
    estimates: dict[tuple[str, str, int, str], tuple[int, str]], name: str, dtype: str, d: int, provider: str
) -> tuple[int, str] | None:
    """The estimate of the kernels ``provider`` runs for this pass, or None where the profile has none."""
    if name == "forward":
        return estimates.get((name, dtype, d, "forward")) if provider in DEFAULT_FORWARD else None
    one = None if provider == "triton-det" else estimates.get((name, dtype, d, "one kernel"))
    return one or estimates.get((name, dtype, d, "two kernels"))


def table(
    estimates: dict[tuple[str, str, int, str], tuple[int, str]], rows: list[dict[str, str]], seq_len: int
) -> list[str]:
    out = [
        f"{'pass':<9} {'dtype':<9} {'D':>4}  {'provider':<12} {'estimate':>8}  {'basis':<12}  "
        f"measured (TFLOP/s, N = {seq_len})"
    ]
    bases = {}
    for r in rows:
        name = PASSES.get(r["pass"])
        if name is None or not r["provider"].startswith("triton") or r["causal"] != "False":
            continue
        if int(r["seq_len"]) != seq_len:
            continue
        dtype = DTYPES.get(r["dtype"], r["dtype"])
        est = estimate_for(estimates, name, dtype, int(r["head_dim"]), r["provider"])
        got = f"{float(r['tflops']):.0f}" if r["status"] == "ok" else "not measured: " + r["status"][:48]
        value, basis = (f"{est[0]}", label(est[1])) if est else ("-", "-")
        if est:
            bases[label(est[1])] = bases.get(label(est[1]), set()) | {est[1]}
        out.append(f"{name:<9} {dtype:<9} {r['head_dim']:>4}  {r['provider']:<12} {value:>8}  {basis:<12}  {got}")
    for key in sorted(bases):
        out += [f"# {key}, as the loop profile printed it: {b}" for b in sorted(bases[key])]
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
