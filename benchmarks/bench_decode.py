"""Decode rows: one decode step (one new query per head) against a KV cache, this library's
``flash_attention_with_kvcache`` against torch's SDPA.

    python benchmarks/bench_decode.py              # bf16 on CUDA, the grid below (run_gpu_suite.sh runs this)
    python benchmarks/bench_decode.py --cpu        # small float32 rows on the CPU
    python benchmarks/bench_decode.py --cpu --shape 4,8192,32,8,128   # B,N,H_q,H_kv,D rows instead of the grid
    python benchmarks/bench_decode.py --out DIR    # default: $OUT/decode if OUT is set, else
                                                   # benchmarks/results/local/decode (or decode-cpu)

Grid (CUDA): batch B in {1, 4, 16, 64}, cache length N in {1k, 4k, 16k, 64k, 128k}, H_q = 32, H_kv = 8
(Llama's grouped-query heads), D = 128, bf16; every batch element's cache holds N keys (``cache_seqlens = N``,
``N_max = N``). A row whose caches do not fit in 80% of the free GPU memory is recorded as skipped.
Providers (``provider``):

- ``ours``: ``flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=...)``, ``num_splits=0`` (the
  split count the library picks from the SM count, in ``splits``): the Triton decode kernel on CUDA;
- ``ours-1split``: the same with ``num_splits=1`` (one program per batch element and key/value head);
- ``ours-paged16``, ``ours-paged256``: the same keys in a paged pool (``block_table``, pages of 16 or 256 keys,
  head-major ``(num_blocks, H_kv, page_size, D)``, the pages in a shuffled order), ``num_splits=0``;
- ``sdpa``: ``F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)`` with no mask, one call
  over the whole cache: SDPA's best case, possible here only because every cache is full;
- ``sdpa-mask``: the same call with the bool key-padding mask ``(B, 1, 1, N)`` built from ``cache_seqlens``,
  what a batch of caches of different lengths needs (padded to the longest, and every padded key is read).

``time_ms``: median of ``triton.testing.do_bench`` (best of 3 on the CPU), the whole call from Python
(validation and launches included). ``gbps``: the cache bytes a decode step must read, ``B H_kv N (D + D_v)``
elements, per second. ``max_err``: against the fp32 oracle on batch element 0 (plain torch). Every row
fails soft: an error or out-of-memory is recorded in ``status`` and the script goes on, writing the rows after
every cell so that a timeout keeps what finished.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if importlib.util.find_spec("flashattn_teach") is None:  # not installed: run from the checkout
    sys.path.insert(0, str(HERE.parent / "src"))

from _machine import machine_info  # noqa: E402

PROVIDERS = ("ours", "ours-1split", "ours-paged16", "ours-paged256", "sdpa", "sdpa-mask")
CSV_COLUMNS = (
    "batch",
    "cache",
    "heads_q",
    "heads_kv",
    "head_dim",
    "dtype",
    "provider",
    "splits",
    "status",
    "time_ms",
    "gbps",
    "max_err",
    "gpu",
    "cpu",
    "torch",
    "triton",
    "date",
)


@dataclass(frozen=True)
class Shape:
    """One decode step: ``q (B, H_q, 1, D)`` over caches ``(B, H_kv, N, D)`` holding N keys each."""

    batch: int
    cache: int
    heads_q: int
    heads_kv: int
    head_dim: int

    @property
    def cache_elements(self) -> int:
        """Elements of K and V a step reads: ``B H_kv N (D + D_v)``."""
        return self.batch * self.heads_kv * self.cache * 2 * self.head_dim


def shapes(cpu: bool) -> list[Shape]:
    if cpu:
        return [Shape(b, n, 8, 2, 64) for n in (256, 1024) for b in (1, 4)]
    return [Shape(b, n, 32, 8, 128) for n in (1024, 4096, 16384, 65536, 131072) for b in (1, 4, 16, 64)]


def provider_call(provider: str, s: Shape, q, k_cache, v_cache, lengths) -> Callable[[], object]:
    """The call one provider makes for a step (module docs)."""
    import torch.nn.functional as F

    import flashattn_teach as fa

    if provider.startswith("ours-paged"):
        k_pool, v_pool, table = paged(k_cache, v_cache, int(provider.removeprefix("ours-paged")))
        return lambda: fa.flash_attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=lengths, block_table=table)
    if provider.startswith("ours"):
        splits = 1 if provider == "ours-1split" else 0
        return lambda: fa.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, num_splits=splits)
    if provider == "sdpa":
        return lambda: F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)
    import torch

    keys = torch.arange(s.cache, device=q.device)
    mask = (keys[None, :] < lengths[:, None])[:, None, None]  # (B, 1, 1, N): True where a key is valid
    return lambda: F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)


def paged(k_cache, v_cache, page_size: int):
    """The caches ``(B, H_kv, N, D)`` as pools of pages ``(B N / page_size, H_kv, page_size, D)`` in a shuffled
    order, and the block table ``(B, N / page_size)`` int32 that finds them: the same keys, paged."""
    import torch

    B, H_kv, N, _ = k_cache.shape
    per_row = N // page_size
    order = torch.randperm(B * per_row, generator=torch.Generator().manual_seed(0)).to(k_cache.device)
    table = order.reshape(B, per_row).to(torch.int32)  # page j of row b sits at block table[b, j]
    pools = []
    for cache in (k_cache, v_cache):
        # (B, H_kv, N, D) -> (B, H_kv, per_row, page_size, D) -> (B per_row, H_kv, page_size, D), row-major pages
        pages = cache.reshape(B, H_kv, per_row, page_size, -1).transpose(1, 2).reshape(B * per_row, H_kv, page_size, -1)
        pool = torch.empty_like(pages)
        pool[order] = pages  # page i (row i // per_row, page i % per_row) goes to block order[i]
        pools.append(pool)
        del pages
    return pools[0], pools[1], table


def oracle_error(out, q, k_cache, v_cache) -> float:
    """``max |out - O|`` on batch element 0, ``O`` by plain torch in fp32 (query head h reads kv head h // G)."""
    import torch

    G = q.shape[1] // k_cache.shape[1]
    k0 = k_cache[0].float().repeat_interleave(G, dim=0)  # (H_q, N, D)
    v0 = v_cache[0].float().repeat_interleave(G, dim=0)
    S = (q[0].float() @ k0.transpose(1, 2)) * q.shape[-1] ** -0.5  # (H_q, 1, D) @ (H_q, D, N) -> (H_q, 1, N)
    O = torch.softmax(S, dim=-1) @ v0  # (H_q, 1, N) @ (H_q, N, D) -> (H_q, 1, D)
    return (out[0].float() - O).abs().max().item()


def timer(cuda: bool, warmup: int, rep: int) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of a call: ``triton.testing.do_bench`` on CUDA, best of 3 on the CPU."""
    if cuda:
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))

    def best_of_3(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * min(times)

    return best_of_3


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:160]


def run_shape(s: Shape, args: argparse.Namespace, cuda: bool) -> list[dict[str, object]]:
    """Every provider on one shape; failures become a status, never an exception."""
    import torch

    from flashattn_teach.serving import splitkv

    dtype = torch.bfloat16 if cuda else torch.float32
    device = "cuda" if cuda else "cpu"
    base = {**asdict(s), "dtype": str(dtype).removeprefix("torch.")}
    cache_bytes = s.cache_elements * dtype.itemsize
    if cuda and cache_bytes > 0.8 * torch.cuda.mem_get_info()[0]:
        return [
            {**base, "provider": p, "status": f"skipped: caches of {cache_bytes / 2**30:.1f} GiB"}
            for p in args.providers
        ]
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(s.batch, s.heads_q, 1, s.head_dim, device=device, generator=g).to(dtype)
    k_cache, v_cache = (
        torch.randn(s.batch, s.heads_kv, s.cache, s.head_dim, device=device, generator=g, dtype=dtype) for _ in range(2)
    )
    lengths = torch.full((s.batch,), s.cache, dtype=torch.int32, device=device)
    measure = timer(cuda, args.warmup, args.rep)
    rows = []
    for provider in args.providers:
        row: dict[str, object] = {**base, "provider": provider}
        if provider == "ours" or provider.startswith("ours-paged"):
            row["splits"] = splitkv.default_num_splits(q, k_cache, s.cache)
        elif provider == "ours-1split":
            row["splits"] = 1
        try:
            call = provider_call(provider, s, q, k_cache, v_cache, lengths)
            with torch.no_grad():
                row["max_err"] = oracle_error(call(), q, k_cache, v_cache)  # also the warm-up (and compilation)
                row["time_ms"] = measure(call)
            row["gbps"] = cache_bytes / (row["time_ms"] * 1e-3) / 1e9
            row["status"] = "ok" if row["max_err"] <= 1e-2 else "wrong output"
        except Exception as e:  # out of memory, an unsupported backend: record it and go on
            row["status"] = f"error: {type(e).__name__}: {_first_line(e)}"
        if cuda:
            torch.cuda.empty_cache()
        rows.append(row)
    del q, k_cache, v_cache
    if cuda:
        torch.cuda.empty_cache()
    return rows


def _fmt(x: object) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def write_rows(rows: list[dict], machine: dict[str, object], out: Path) -> None:
    """``decode.csv`` (one row per shape and provider), ``decode.json`` (with the machine) and ``decode.md``
    (one line per shape: each provider's time and bandwidth)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "decode.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(CSV_COLUMNS), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(v) for k, v in {**machine, **r}.items()})
    (out / "decode.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    cells: dict[tuple[int, int], dict[str, str]] = {}
    for r in rows:
        ok = r.get("status") == "ok"
        text = f"{r['time_ms']:.3g} ms, {r['gbps']:.3g} GB/s" if ok else str(r.get("status", ""))
        cells.setdefault((r["batch"], r["cache"]), {})[str(r["provider"])] = text
    where = machine.get("gpu", machine["cpu"])
    lines = [
        f"Decode step, {where}, torch {machine['torch']}, triton {machine['triton']}, {machine['date']}",
        "",
        "| B | cache | " + " | ".join(providers) + " |",
        "|---|---|" + "---|" * len(providers),
    ]
    lines += [f"| {b} | {n} | " + " | ".join(c.get(p, "") for p in providers) + " |" for (b, n), c in cells.items()]
    (out / "decode.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    env_out = os.environ.get("OUT")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="small float32 rows on the CPU")
    p.add_argument(
        "--shape", action="append", default=None, metavar="B,N,H_q,H_kv,D", help="a row, not the grid (repeatable)"
    )
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--warmup", type=int, default=10, help="do_bench warm-up, ms (default 10)")
    p.add_argument("--rep", type=int, default=30, help="do_bench measuring time, ms (default 30)")
    p.add_argument("--out", type=Path, default=None, help="output directory (see the module docstring)")
    args = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and not args.cpu:
        print("CUDA is absent (torch.cuda.is_available() is False): no decode rows (--cpu runs small ones)")
        return 0
    name = "decode" if cuda else "decode-cpu"
    out = args.out or (Path(env_out) / name if env_out else HERE / "results" / "local" / name)
    machine = machine_info(gpu=cuda)
    print(
        f"{machine.get('gpu', machine['cpu'])}, torch {machine['torch']}, triton {machine['triton']}, {machine['date']}"
    )
    rows: list[dict[str, object]] = []
    start = time.perf_counter()
    grid = [Shape(*(int(x) for x in text.split(","))) for text in args.shape] if args.shape else shapes(not cuda)
    for s in grid:
        new = run_shape(s, args, cuda)
        rows.extend(new)
        summary = ", ".join(f"{r['provider']} {_fmt(r.get('time_ms', r['status']))}" for r in new)
        print(f"[{time.perf_counter() - start:5.0f} s] B={s.batch} cache={s.cache}: {summary}", flush=True)
        write_rows(rows, machine, out)  # after every shape: a timeout keeps them
    print((out / "decode.md").read_text())
    print(f"wrote {out / 'decode.csv'}, {out / 'decode.json'} and {out / 'decode.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
