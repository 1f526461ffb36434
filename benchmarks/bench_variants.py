"""CPU time and peak memory of the masked variants: a padded batch, a sliding window, key lengths, packed
sequences; this library's fast CPU path against torch's SDPA given the equivalent dense mask, and the dense
oracle.

    python benchmarks/bench_variants.py              # the README's sizes (minutes on 2 cores: the dense rows)
    python benchmarks/bench_variants.py --quick      # tiny sizes, seconds (the smoke test)
    python benchmarks/bench_variants.py --out DIR    # variants.csv, variants.json
                                                     # (default benchmarks/results/local/variants)

Rows (``case``):

- ``left_pad``: a causal batch left-padded as a Hugging Face tokenizer pads it, with the bool mask
  ``(B, 1, N, N)`` the model builds, through ``scaled_dot_product_attention`` (the drop-in, which reads the
  mask tile by tile) and torch's SDPA with that same mask;
- ``window``: ``window=(W, 0)`` through ``flash_attention``, against SDPA with the banded bool mask ``(N, N)``;
- ``seqlens_k``: right-padded keys, ``seqlens_k=`` against SDPA with the key-padding mask ``(B, 1, 1, N)``;
- ``varlen``: packed sequences through ``flash_attention_varlen`` against SDPA on
  the packed batch with the block-diagonal causal mask ``(T, T)``.

How memory is measured: every row runs in a fresh subprocess. It builds the inputs, and the mask when its
implementation takes one, then resets the kernel's peak-RSS mark (``echo 5 > /proc/self/clear_refs``,
Linux) after one warm-up call and reads ``VmRSS``; after the timed calls ``VmHWM`` is the peak. ``added_mib`` is
``VmHWM - VmRSS``: what the calls themselves held at their peak, over the inputs and mask already resident
(the mask's own size is ``mask_mib``). The worker runs with ``MALLOC_MMAP_THRESHOLD_=131072``, so glibc
maps every large block afresh and unmaps it on free: memory freed while building the inputs cannot be
reused unseen by the calls, and the RSS follows what is live. Mapping every block afresh also makes
each call pay the page faults of its buffers (on the left-padded row 365 ms against 200 ms for ours, 275
against 201 ms for SDPA), so the times come from a second fresh process per row with glibc's default
malloc, and the memory columns from the first. Where ``clear_refs`` is not writable the
peak is ``ru_maxrss`` over the whole process (``memory_method`` says which). Times are the median of the
timed calls after one warm-up call, with torch's default threading; a one-off, never a CI gate.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_info

HERE = Path(__file__).resolve().parent
IMPLS = ("ours", "sdpa", "dense")
CASES = ("left_pad", "window", "seqlens_k", "varlen")
CSV_COLUMNS = (
    "case",
    "impl",
    "call",
    "shape",
    "options",
    "threads",
    "repeats",
    "time_ms",
    "time_min_ms",
    "rss_before_mib",
    "peak_rss_mib",
    "added_mib",
    "mask_mib",
    "memory_method",
    "status",
)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}  # large blocks mmapped and unmapped on free (see above)
TIME_COLUMNS = ("repeats", "time_ms", "time_min_ms")  # taken from the second run, without MALLOC_ENV


@dataclass(frozen=True)
class Sizes:
    """One run's problem sizes; ``--quick`` shrinks them all."""

    batch: int = 2
    heads: int = 8
    seq_len: int = 2048
    head_dim: int = 64
    left_pad: tuple[int, ...] = (0, 600)  # left padding of each batch element (left_pad)
    window_len: int = 4096  # N of the window case
    window: int = 256  # window=(W, 0)
    seqlens_k: tuple[int, ...] = (2048, 1500, 1000, 300)  # key lengths (seqlens_k), batch = len(...)
    varlen: tuple[int, ...] = (1000, 600, 300, 148)  # packed sequence lengths (varlen)


QUICK = Sizes(batch=2, heads=2, seq_len=64, head_dim=16, left_pad=(0, 20), window_len=96, window=16,
              seqlens_k=(64, 40), varlen=(30, 1, 33))  # fmt: skip


# ------------------------------------------------------------------------------------------ memory


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> bool:
    """Reset the peak-RSS mark to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_mib(resettable: bool) -> float:
    if resettable:
        return _status_kib("VmHWM") / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _rss_mib() -> float:
    try:
        return _status_kib("VmRSS") / 1024
    except (OSError, KeyError):
        return math.nan


# ------------------------------------------------------------------------------------------ the rows


def build(case: str, impl: str, sizes: Sizes):
    """``(call, description, shape, options, mask)``: a zero-argument call on inputs built here, and the
    mask it holds (None if it takes none). The mask is built only for the implementation that needs it."""
    import torch
    import torch.nn.functional as F

    import flashattn_teach as fa

    gen = torch.Generator().manual_seed(0)
    H, D = sizes.heads, sizes.head_dim

    def randn(*shape: int):
        return torch.randn(*shape, generator=gen)

    if case == "left_pad":
        B, N = len(sizes.left_pad), sizes.seq_len
        q, k, v = (randn(B, H, N, D) for _ in range(3))
        i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
        pad = torch.tensor(sizes.left_pad)[:, None, None, None]
        mask = (j <= i) & (j >= pad)  # (B, 1, N, N): causal, and no padded key visible, as HF builds it
        calls = {
            "ours": ("fa.scaled_dot_product_attention(attn_mask=mask)",
                     lambda: fa.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
            "sdpa": ("F.scaled_dot_product_attention(attn_mask=mask)",
                     lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
            "dense": ("fa.flash_attention(attn_mask=mask, backend='dense')",
                      lambda: fa.flash_attention(q, k, v, attn_mask=mask, backend="dense")),
        }  # fmt: skip
        return (*calls[impl], (B, H, N, D), f"left padding {sizes.left_pad}, causal", mask)
    if case == "window":
        N, W = sizes.window_len, sizes.window
        q, k, v = (randn(1, H, N, D) for _ in range(3))
        if impl == "ours":
            call = lambda: fa.flash_attention(q, k, v, window=(W, 0))  # noqa: E731
            return "fa.flash_attention(window=(W, 0))", call, (1, H, N, D), f"window ({W}, 0)", None
        if impl == "dense":
            call = lambda: fa.flash_attention(q, k, v, window=(W, 0), backend="dense")  # noqa: E731
            return "fa.flash_attention(window=(W, 0), backend='dense')", call, (1, H, N, D), f"window ({W}, 0)", None
        i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
        band = (j <= i) & (j >= i - W)  # (N, N)
        call = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=band)  # noqa: E731
        return "F.scaled_dot_product_attention(attn_mask=band)", call, (1, H, N, D), f"window ({W}, 0)", band
    if case == "seqlens_k":
        B, N = len(sizes.seqlens_k), sizes.seq_len
        q, k, v = (randn(B, H, N, D) for _ in range(3))
        lengths = torch.tensor(sizes.seqlens_k)
        options = f"seqlens_k {sizes.seqlens_k}"
        if impl in ("ours", "dense"):
            backend = "auto" if impl == "ours" else "dense"
            call = lambda: fa.flash_attention(q, k, v, seqlens_k=lengths, backend=backend)  # noqa: E731
            return f"fa.flash_attention(seqlens_k=..., backend={backend!r})", call, (B, H, N, D), options, None
        keys = (torch.arange(N)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, N)
        call = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keys)  # noqa: E731
        return "F.scaled_dot_product_attention(attn_mask=key padding)", call, (B, H, N, D), options, keys
    if case == "varlen":
        lens = torch.tensor(sizes.varlen)
        T = int(lens.sum())
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
        options = f"causal, sequences {sizes.varlen}"
        q, k, v = (randn(T, H, D) for _ in range(3))  # flash-attn's packed layout (total, H, D)
        if impl in ("ours", "dense"):
            backend = "auto" if impl == "ours" else "dense"
            L = int(lens.max())
            call = lambda: fa.flash_attention_varlen(q, k, v, cu, cu, L, L, causal=True, backend=backend)  # noqa: E731
            return f"fa.flash_attention_varlen(causal=True, backend={backend!r})", call, (T, H, D), options, None
        seq = torch.repeat_interleave(torch.arange(len(lens)), lens)  # (T,): which sequence each token is in
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        block_diagonal = (seq[:, None] == seq[None, :]) & (j <= i)  # (T, T)
        qt, kt, vt = (t.transpose(0, 1) for t in (q, k, v))  # (H, T, D)
        call = lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=block_diagonal).transpose(0, 1)  # noqa: E731
        return "F.scaled_dot_product_attention(attn_mask=block diagonal)", call, (T, H, D), options, block_diagonal
    raise ValueError(f"unknown case {case!r}")


def worker(args: argparse.Namespace) -> dict[str, object]:
    """One row, in this process: build, warm up, reset the peak mark, time."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else Sizes()
    with torch.no_grad():
        described, call, shape, options, mask = build(args.case, args.impl, sizes)
        start = time.perf_counter()
        call()  # warm-up (lazy imports, thread pools), and the first estimate of one call's time
        first = time.perf_counter() - start
        resettable = _reset_peak()  # the peak of the timed calls alone, over what the warm-up left resident
        before = _rss_mib() if resettable else _peak_mib(resettable=False)
        repeats = max(1, min(args.max_repeats, math.ceil(args.min_time / max(first, 1e-6))))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        peak = _peak_mib(resettable)
    times.sort()
    return {
        "call": described,
        "shape": "x".join(map(str, shape)),
        "options": options,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "time_ms": 1e3 * times[len(times) // 2],
        "time_min_ms": 1e3 * times[0],
        "rss_before_mib": before,
        "peak_rss_mib": peak,
        "added_mib": max(0.0, peak - before),
        "mask_mib": 0.0 if mask is None else mask.numel() * mask.element_size() / 2**20,
        "memory_method": "VmHWM after clear_refs" if resettable else "ru_maxrss (whole process)",
    }


# ------------------------------------------------------------------------------------------ driver


def _spawn(case: str, impl: str, opts: argparse.Namespace, malloc_env: dict[str, str]) -> dict[str, object]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--case", case, "--impl", impl,
           "--min-time", str(opts.min_time), "--max-repeats", str(opts.max_repeats), "--threads", str(opts.threads),
           *(["--quick"] if opts.quick else [])]  # fmt: skip
    src = str(HERE.parent / "src")
    env = {**os.environ, **malloc_env, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.cell_timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout after {opts.cell_timeout:g} s"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": f"error (rc {proc.returncode}): {last[:200]}"}
    return {"status": "ok", **json.loads(proc.stdout.strip().splitlines()[-1])}


def _fmt(x: object) -> str:
    return f"{x:.1f}" if isinstance(x, float) else str(x)


def print_table(rows: list[dict[str, object]]) -> None:
    columns = ("case", "impl", "shape", "options", "time_ms", "added_mib", "mask_mib", "peak_rss_mib", "status")
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[n]) for row in cells)) for n, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds): the smoke test")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--threads", type=int, default=0, help="torch threads per row (default: torch's)")
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds of timed calls per row, at least")
    parser.add_argument("--max-repeats", type=int, default=10)
    parser.add_argument("--cell-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "local" / "variants")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker:
        print(json.dumps(worker(opts)))
        return 0

    machine = machine_info()
    sizes = QUICK if opts.quick else Sizes()
    rows = []
    for case in opts.cases:
        for impl in opts.impls:
            row: dict[str, object] = {"case": case, "impl": impl}
            row.update(_spawn(case, impl, opts, MALLOC_ENV))  # the memory columns
            if row["status"] == "ok":  # the time columns, from a process with glibc's default malloc (docs)
                timed = _spawn(case, impl, opts, {})
                row.update({k: timed[k] for k in TIME_COLUMNS} if timed["status"] == "ok" else timed)
            rows.append(row)
            print(f"{case:>10} {impl:>5}: {row['status']}", file=sys.stderr)
    print(f"{machine['cpu']} · {machine['cpu_count']} CPUs · torch {machine['torch']} · {machine['date']}")
    print_table(rows)
    opts.out.mkdir(parents=True, exist_ok=True)
    with open(opts.out / "variants.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({c: r.get(c, "") for c in CSV_COLUMNS})
    record = {"machine": machine, "sizes": asdict(sizes), "malloc_env": MALLOC_ENV, "rows": rows}
    (opts.out / "variants.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {opts.out / 'variants.csv'} and {opts.out / 'variants.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
