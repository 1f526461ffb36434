"""One decode step on the CPU paths: a paged KV cache against a contiguous one, the same keys and lengths.

    python benchmarks/decode_paged_cpu.py                  # B=4 H_q=8 H_kv=2 D=64 L=4096 float32, 30 repeats
    python benchmarks/decode_paged_cpu.py --repeats 50 --out DIR

Layouts (``layout``), each holding the same keys, every batch element ``L`` of them (``cache_seqlens = L - 1``
and one new key and value appended by the step, as in a decode loop):

- ``contiguous``: ``k_cache (B, H_kv, L, D)``;
- ``paged-16`` and ``paged-256``: a pool of pages ``(num_blocks, H_kv, page_size, D)`` (head-major) with a
  shuffled block table (``torch.randperm``), so every range gathers its pages;
- ``paged-16-fa``: flash-attn's pool ``(num_blocks, page_size, H_kv, D)`` passed as its ``.transpose(1, 2)``
  view, the pages of each sequence consecutive, so each range is read as a strided view of the pool.

The calls are interleaved (one of each layout per repeat, so a change of load hits every layout alike) and
``median_ms`` is the median over the repeats, ``ratio`` that over the contiguous median (``min_ms`` and
``min_ratio`` the same for the fastest repeat, the steadier figure on a shared machine). ``load`` is
``/proc/loadavg`` before and after. Every layout's output is checked against the contiguous one. A one-off;
never a CI gate.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if importlib.util.find_spec("flashattn_teach") is None:  # not installed: run from the checkout
    sys.path.insert(0, str(HERE.parent / "src"))

import torch  # noqa: E402

import flashattn_teach as fa  # noqa: E402
from _machine import machine_info  # noqa: E402


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


def layouts(B: int, H_kv: int, L: int, D: int, g: torch.Generator) -> dict[str, tuple]:
    """``name -> (k_cache, v_cache, block_table or None)``, every layout holding the same keys."""
    k = torch.randn(B, H_kv, L, D, generator=g)
    v = torch.randn(B, H_kv, L, D, generator=g)
    out: dict[str, tuple] = {"contiguous": (k.clone(), v.clone(), None)}
    for page_size in (16, 256):
        n = L // page_size  # pages per sequence
        table = torch.randperm(B * n, generator=g).reshape(B, n).to(torch.int32)
        pools = []
        for cache in (k, v):
            # (B, H_kv, n, page_size, D) -> (B, n, H_kv, page_size, D) -> (B n, H_kv, page_size, D)
            pages = cache.reshape(B, H_kv, n, page_size, D).transpose(1, 2).reshape(B * n, H_kv, page_size, D)
            pool = torch.empty_like(pages)
            pool[table.flatten().long()] = pages  # page p of sequence b at block id table[b, p]
            pools.append(pool)
        out[f"paged-{page_size}"] = (*pools, table)
    n = L // 16
    table = torch.arange(B * n).reshape(B, n).to(torch.int32)  # consecutive pages per sequence
    fa_pools = []
    for cache in (k, v):
        # (B, H_kv, L, D) -> (B, L, H_kv, D) -> (B n, 16, H_kv, D): flash-attn's pool, seen head-major
        fa_pools.append(cache.transpose(1, 2).reshape(B * n, 16, H_kv, D).clone().transpose(1, 2))
    out["paged-16-fa"] = (*fa_pools, table)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads-q", type=int, default=8)
    p.add_argument("--heads-kv", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--length", type=int, default=4096, help="keys per sequence after the step (a multiple of 256)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default benchmarks/results/local)")
    args = p.parse_args(argv)
    B, H_q, H_kv, D, L = args.batch, args.heads_q, args.heads_kv, args.head_dim, args.length
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    caches = layouts(B, H_kv, L, D, g)
    q = torch.randn(B, H_q, 1, D, generator=g)
    k_new, v_new = torch.randn(B, H_kv, 1, D, generator=g), torch.randn(B, H_kv, 1, D, generator=g)
    lengths = torch.full((B,), L - 1, dtype=torch.int32)

    def step(name: str) -> torch.Tensor:
        k_cache, v_cache, table = caches[name]
        return fa.flash_attention_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, block_table=table
        )

    reference = step("contiguous")
    errors = {name: (step(name) - reference).abs().max().item() for name in caches}  # also the warm-up
    times: dict[str, list[float]] = {name: [] for name in caches}
    load_before = _load()
    for _ in range(args.repeats):
        for name in caches:
            start = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - start)
    load_after = _load()
    base = statistics.median(times["contiguous"])
    rows = [
        {
            "layout": name,
            "median_ms": round(1e3 * statistics.median(t), 3),
            "ratio": round(statistics.median(t) / base, 3),
            "min_ms": round(1e3 * min(t), 3),
            "min_ratio": round(min(t) / min(times["contiguous"]), 3),
            "max_diff_vs_contiguous": errors[name],
        }
        for name, t in times.items()
    ]
    shape = {"B": B, "H_q": H_q, "H_kv": H_kv, "D": D, "L": L, "dtype": "float32", "repeats": args.repeats,
             "threads": torch.get_num_threads()}  # fmt: skip
    print(f"one decode step, CPU, {shape}; torch threads {torch.get_num_threads()}")
    print(f"load before {load_before}; after {load_after}")
    print(f"{'layout':>12} {'median ms':>10} {'ratio':>6} {'min ms':>8} {'ratio':>6} {'max diff':>9}")
    for r in rows:
        print(
            f"{r['layout']:>12} {r['median_ms']:>10.3f} {r['ratio']:>6.3f} {r['min_ms']:>8.3f} {r['min_ratio']:>6.3f} "
            f"{r['max_diff_vs_contiguous']:>9.1e}"
        )
    out = args.out or (Path(os.environ["OUT"]) if "OUT" in os.environ else HERE / "results" / "local")
    out.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine_info(), "shape": shape, "load": [load_before, load_after], "rows": rows}
    (out / "decode_paged_cpu.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out / 'decode_paged_cpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
