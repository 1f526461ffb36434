"""GPU attention benchmark: this library's Triton path against torch SDPA's backends, flash-attn and the dense
reference, with FLOP/s, peak memory and a roofline position per cell.

    python benchmarks/bench_attention.py             # full grid (bf16, fp16; D = 64, 128, 256; N = 512..16k)
    python benchmarks/bench_attention.py --trimmed   # bf16, D = 64, 128, N = 2k, 8k: run_gpu_suite.sh's grid
    python benchmarks/bench_attention.py --out DIR   # default: $OUT if set, else benchmarks/results/gpu

Grid as in the FlashAttention papers: B * N = 16k tokens, H = 2048 / D heads (hidden size 2048), causal and
not. Per cell and provider: the forward output is first checked against an fp32 oracle on a sample of query
rows; then forward, backward and forward+backward are timed (median of ``triton.testing.do_bench``, inputs
rotated across copies so the L2 cache does not flatter) and their peak memory is taken from
``torch.cuda.max_memory_allocated`` after a reset. FLOPs: ``4 B H N^2 D`` forward, halved if causal, backward
2.5x (see ``flashattn_teach.tools.iomodel``). Without CUDA the script says so, prints the IO model of the grid and
exits 0.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import inspect
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if importlib.util.find_spec("flashattn_teach") is None:  # not installed: run from the checkout
    sys.path.insert(0, str(HERE.parent / "src"))

from _machine import machine_info  # noqa: E402
from flashattn_teach.tools import iomodel  # noqa: E402

PASSES = ("fwd", "bwd", "fwd+bwd")
IOMODEL_PASS = {"fwd": "forward", "bwd": "backward", "fwd+bwd": "forward+backward"}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
TOKENS = 16384  # B * N, as in the FlashAttention papers' benchmarks
HIDDEN = 2048  # H * D
DEVICE = "cuda"
TILED_BLOCKS = (128, 64)  # BLOCK_M, BLOCK_N assumed for the modelled bytes of every fused kernel
COLORS = {
    "triton": "tab:red",
    "triton-ptr": "tab:orange",
    "triton-nows": "tab:pink",
    "triton-det": "tab:brown",
    "sdpa-flash": "tab:blue",
    "sdpa-efficient": "tab:cyan",
    "sdpa-cudnn": "tab:purple",
    "sdpa-math": "tab:gray",
    "flash_attn": "tab:green",
    "dense": "black",
}
CSV_COLUMNS = (
    "provider",
    "dtype",
    "head_dim",
    "causal",
    "seq_len",
    "batch",
    "heads",
    "pass",
    "status",
    "time_ms",
    "tflops",
    "peak_mib",
    "added_mib",
    "max_err",
    "ref_err",
    "model_bytes",
    "gbps",
    "intensity",
    "frac_peak_tflops",
    "frac_peak_bw",
    "frac_roofline",
    "ceiling_tflops",
    "ceiling_gbps",
    "gpu",
    "driver",
    "torch",
    "triton",
    "date",
)


@dataclass(frozen=True)
class Cell:
    dtype: str
    head_dim: int
    causal: bool
    seq_len: int

    @property
    def batch(self) -> int:
        return max(1, TOKENS // self.seq_len)

    @property
    def heads(self) -> int:
        return max(1, HIDDEN // self.head_dim)

    def problem(self) -> iomodel.Problem:
        return iomodel.Problem(self.batch, self.heads, self.seq_len, self.head_dim, 2, self.causal)


@dataclass(frozen=True)
class Provider:
    name: str
    fn: Callable  # (q, k, v, causal) -> out, all in the provider's layout
    layout: str = "bhnd"  # flash-attn takes (B, N, H, D)
    materialises_scores: bool = False  # holds N x N matrices: skipped where they would not fit


# ------------------------------------------------------------------------------------------ grid


def make_grid(args: argparse.Namespace) -> list[Cell]:
    return [Cell(dt, d, c, n) for dt in args.dtypes for d in args.head_dims for c in args.causal for n in args.seq_lens]


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    for line in (header, ["-" * w for w in widths], *rows):
        print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))


def iomodel_rows(cells: list[Cell]) -> list[dict[str, object]]:
    """What can be known without a GPU: FLOPs and modelled HBM bytes of every cell."""
    rows = []
    for cell, pass_ in itertools.product(cells, PASSES):
        p = cell.problem()
        rows.append(
            {
                "dtype": cell.dtype,
                "head_dim": cell.head_dim,
                "causal": cell.causal,
                "seq_len": cell.seq_len,
                "batch": cell.batch,
                "heads": cell.heads,
                "pass": pass_,
                "gflop": iomodel.attention_flops(p, IOMODEL_PASS[pass_]) / 1e9,
                "tiled_mib": model_bytes(p, pass_, tiled=True) / 2**20,
                "standard_mib": model_bytes(p, pass_, tiled=False) / 2**20,
            }
        )
    return rows


def model_bytes(p: iomodel.Problem, pass_: str, tiled: bool) -> int:
    """Modelled HBM bytes: FA2's query-major forward and split backward for fused kernels, Alg. 0/3 otherwise."""
    bm, bn = TILED_BLOCKS
    fwd = iomodel.query_major_forward_io(p, bm, bn) if tiled else iomodel.standard_forward_io(p)
    bwd = iomodel.split_backward_io(p, bm, bn) if tiled else iomodel.standard_backward_io(p)
    return {"fwd": fwd.total_bytes, "bwd": bwd.total_bytes, "fwd+bwd": fwd.total_bytes + bwd.total_bytes}[pass_]


# --------------------------------------------------------------------------------------- providers


# The KernelConfig field that turns the forward's warp specialisation on, under the names it may have.
WS_FIELDS = ("ws", "warp_specialize", "warp_specialized")


def _warp_specialised_field() -> str | None:
    from flashattn_teach.triton.configs import KernelConfig

    names = {f.name for f in dataclasses.fields(KernelConfig)}
    return next((n for n in WS_FIELDS if n in names), None)


def make_providers(selected: list[str] | None) -> tuple[list[Provider], dict[str, str]]:
    """Every provider that can be constructed here, and why the others cannot."""
    import torch.nn.functional as F

    import flashattn_teach

    def triton_pointer_path(q, k, v, c):
        """The shipped configuration with the forward's key/value loads through pointers instead of TMA."""
        from flashattn_teach.triton import shipped_config, triton_attention
        from flashattn_teach.triton.configs import arch_of

        config = shipped_config(q.shape[-1], q.dtype, arch_of(q.device))
        config = dataclasses.replace(config, forward=dataclasses.replace(config.forward, tma=False))
        return triton_attention(q, k, v, causal=c, config=config)

    providers = [
        Provider("triton", lambda q, k, v, c: flashattn_teach.flash_attention(q, k, v, causal=c, backend="triton")),
        Provider("triton-ptr", triton_pointer_path),
    ]
    missing: dict[str, str] = {}
    ws = _warp_specialised_field()
    if ws is None:
        missing["triton-nows"] = "this checkout's KernelConfig has no warp-specialisation field"
    else:

        def triton_not_specialised(q, k, v, c, field=ws):
            """The shipped configuration with the forward's warp specialisation off: the fallback forward."""
            from flashattn_teach.triton import shipped_config, triton_attention
            from flashattn_teach.triton.configs import arch_of

            config = shipped_config(q.shape[-1], q.dtype, arch_of(q.device))
            config = dataclasses.replace(config, forward=dataclasses.replace(config.forward, **{field: False}))
            return triton_attention(q, k, v, causal=c, config=config)

        providers.append(Provider("triton-nows", triton_not_specialised))
    if "deterministic" in inspect.signature(flashattn_teach.flash_attention).parameters:
        providers.append(
            Provider(
                "triton-det",
                lambda q, k, v, c: flashattn_teach.flash_attention(
                    q, k, v, causal=c, backend="triton", deterministic=True
                ),
            )
        )
    else:
        missing["triton-det"] = "this checkout's flash_attention has no deterministic argument"
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        missing["sdpa-*"] = f"torch.nn.attention is missing ({e})"
    else:
        for name, attr in (
            ("sdpa-flash", "FLASH_ATTENTION"),
            ("sdpa-efficient", "EFFICIENT_ATTENTION"),
            ("sdpa-cudnn", "CUDNN_ATTENTION"),
            ("sdpa-math", "MATH"),
        ):
            backend = getattr(SDPBackend, attr, None)
            if backend is None:
                missing[name] = f"this torch has no SDPBackend.{attr}"
                continue

            def sdpa(q, k, v, c, backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=c)

            providers.append(Provider(name, sdpa, materialises_scores=attr == "MATH"))
    try:
        from flash_attn import flash_attn_func
    except Exception as e:  # absent, or built against another torch/CUDA
        missing["flash_attn"] = f"not importable ({type(e).__name__}: {str(e)[:80]})"
    else:
        providers.append(Provider("flash_attn", lambda q, k, v, c: flash_attn_func(q, k, v, causal=c), "bnhd"))
    providers.append(
        Provider(
            "dense", lambda q, k, v, c: flashattn_teach.dense_attention(q, k, v, causal=c), materialises_scores=True
        )
    )
    if selected:
        providers = [p for p in providers if p.name in selected]
    return providers, missing


# ------------------------------------------------------------------------------------------ timing


def bench(fn: Callable[[], object], grad_to_none: list, warmup: int, rep: int) -> float:
    """Median milliseconds of ``fn`` by ``triton.testing.do_bench`` (which also flushes L2 between calls)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median"))


def measure_ceilings(warmup: int, rep: int) -> dict[str, float]:
    """The roofline's two ceilings in this run: a large bf16 matmul and a large device-to-device copy."""
    import torch

    n = 8192
    a, b = (torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    tflops = 2 * n**3 / (bench(lambda: a @ b, [], warmup, rep) * 1e-3) / 1e12
    src = torch.empty(2**30, device=DEVICE, dtype=torch.uint8)
    dst = torch.empty_like(src)
    gbps = 2 * src.numel() / (bench(lambda: dst.copy_(src), [], warmup, rep) * 1e-3) / 1e9  # read + write
    return {"ceiling_tflops": tflops, "ceiling_gbps": gbps}


def _inputs(cell: Cell, provider: Provider, seed: int):
    """q, k, v, dO in the provider's layout (contiguous), requiring grad."""
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    dtype = getattr(torch, DTYPES[cell.dtype])
    shape = (cell.batch, cell.heads, cell.seq_len, cell.head_dim)
    q, k, v, dO = (torch.randn(shape, device=DEVICE, dtype=dtype, generator=g) for _ in range(4))
    if provider.layout == "bnhd":
        q, k, v, dO = (t.transpose(1, 2).contiguous() for t in (q, k, v, dO))
    return [t.requires_grad_(i < 3) for i, t in enumerate((q, k, v, dO))]


def _bhnd(t, provider: Provider):
    return t.transpose(1, 2) if provider.layout == "bnhd" else t


def check_output(out, q, k, v, causal: bool, provider: Provider) -> tuple[float, float]:
    """Max error of ``out`` on sampled query rows of batch 0 against an fp32 oracle, and the error of plain
    torch in the inputs' precision (the yardstick: a kernel should be within about 2x of it)."""
    import torch

    q, k, v, out = (_bhnd(t, provider)[0].detach() for t in (q, k, v, out))  # (H, N, D)
    N, D = q.shape[-2], q.shape[-1]
    rows = torch.unique(
        torch.cat(
            [
                torch.arange(0, 64),
                torch.arange(N - 64, N),
                torch.randint(0, N, (128,), generator=torch.Generator().manual_seed(0)),
            ]
        )
    )
    rows = rows.to(q.device)
    masked = torch.arange(N, device=q.device)[None, :] > rows[:, None]  # (R, N): key after query

    def attend(qs, ks, vs):
        S = qs[:, rows] @ ks.transpose(-2, -1) / math.sqrt(D)  # (H, R, D) @ (H, D, N) -> (H, R, N)
        if causal:
            S = S.masked_fill(masked, float("-inf"))
        return torch.softmax(S, dim=-1).to(vs.dtype) @ vs  # (H, R, N) @ (H, N, D) -> (H, R, D)

    ref = attend(q.float(), k.float(), v.float())
    low = attend(q, k, v).float()
    return (out[:, rows].float() - ref).abs().max().item(), (low - ref).abs().max().item()


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:120]


def run_cell(cell: Cell, provider: Provider, args: argparse.Namespace) -> list[dict[str, object]]:
    """Check, then time and measure every pass of one provider on one cell."""
    import torch

    base = {
        "provider": provider.name,
        "dtype": cell.dtype,
        "head_dim": cell.head_dim,
        "causal": cell.causal,
        "seq_len": cell.seq_len,
        "batch": cell.batch,
        "heads": cell.heads,
    }

    def rows_with(status: str, **extra) -> list[dict[str, object]]:
        return [{**base, "pass": p, "status": status, **extra} for p in args.passes]

    if provider.materialises_scores:
        gib = 12 * cell.batch * cell.heads * cell.seq_len**2 * 4 / 2**30  # fp32 S, P and their gradients
        if gib > args.max_dense_gib:
            return rows_with(f"skipped: ~{gib:.0f} GiB of N x N matrices")
    try:
        q, k, v, dO = _inputs(cell, provider, seed=0)
        out = provider.fn(q, k, v, cell.causal)
        err, ref_err = check_output(out, q, k, v, cell.causal, provider)
        del out
    except (NotImplementedError, ImportError) as e:
        return rows_with(f"not available: {_first_line(e)}")
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return rows_with("out of memory")
    except RuntimeError as e:  # SDPA's "No available kernel", flash-attn's unsupported head dim, ...
        torch.cuda.empty_cache()
        return rows_with(f"not available: {_first_line(e)}")
    except Exception as e:  # e.g. a Triton compilation error: report it, go on with the other providers
        torch.cuda.empty_cache()
        return rows_with(f"error: {type(e).__name__}: {_first_line(e)}")
    tolerance = 2 * ref_err + 1e-3
    if not err <= tolerance:
        return rows_with(f"wrong output: max error {err:.3g} > {tolerance:.3g}", max_err=err, ref_err=ref_err)

    rows = []
    for pass_ in args.passes:
        row = {**base, "pass": pass_, "max_err": err, "ref_err": ref_err}
        try:
            row.update(_measure_pass(cell, provider, pass_, (q, k, v, dO), args))
            row["status"] = "ok"
        except torch.cuda.OutOfMemoryError:
            row["status"] = "out of memory"
        except Exception as e:
            row["status"] = f"error: {type(e).__name__}: {_first_line(e)}"
        torch.cuda.empty_cache()
        rows.append(row)
    return rows


def _measure_pass(cell: Cell, provider: Provider, pass_: str, first, args) -> dict[str, float]:
    import torch

    q, k, v, dO = first
    f = provider.fn

    def clear(ts):
        for t in ts:
            t.grad = None

    # Peak memory with one set of inputs alive: max_memory_allocated after a reset, and what the call added.
    torch.cuda.synchronize()
    out = f(q, k, v, cell.causal) if pass_ == "bwd" else None
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    if pass_ == "fwd":
        out = f(q, k, v, cell.causal)
    elif pass_ == "bwd":
        out.backward(dO)
    else:
        f(q, k, v, cell.causal).backward(dO)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    clear((q, k, v))

    # Timing over rotated copies of the inputs, enough to exceed the L2 cache several times over.
    set_bytes = 4 * q.numel() * q.element_size()
    n_sets = max(2, min(8, math.ceil(512 * 2**20 / set_bytes)))
    sets = [(q, k, v, dO)] + [_inputs(cell, provider, seed=s) for s in range(1, n_sets)]
    leaves = [t for s in sets for t in s[:3]]
    turn = itertools.count()
    if pass_ == "fwd":

        def step():
            s = sets[next(turn) % n_sets]
            return f(s[0], s[1], s[2], cell.causal)
    elif pass_ == "bwd":
        outs = [f(s[0], s[1], s[2], cell.causal) for s in sets]

        def step():
            i = next(turn) % n_sets
            outs[i].backward(sets[i][3], retain_graph=True)
    else:

        def step():
            s = sets[next(turn) % n_sets]
            f(s[0], s[1], s[2], cell.causal).backward(s[3])

    ms = bench(step, leaves, args.warmup, args.rep)
    clear(leaves)
    return {"time_ms": ms, "peak_mib": peak / 2**20, "added_mib": (peak - before) / 2**20}


def add_roofline(row: dict[str, object], ceilings: dict[str, float]) -> None:
    """Achieved TFLOP/s and modelled bytes/s against the measured ceilings."""
    row.update(ceilings)
    if row.get("status") != "ok":
        return
    p = Cell(str(row["dtype"]), int(row["head_dim"]), bool(row["causal"]), int(row["seq_len"])).problem()
    seconds = float(row["time_ms"]) * 1e-3
    flops = iomodel.attention_flops(p, IOMODEL_PASS[str(row["pass"])])
    nbytes = model_bytes(p, str(row["pass"]), tiled=row["provider"] not in ("dense", "sdpa-math"))
    intensity = flops / nbytes
    roof = min(ceilings["ceiling_tflops"], intensity * ceilings["ceiling_gbps"] / 1e3)  # TFLOP/s
    row.update(
        tflops=flops / seconds / 1e12,
        model_bytes=nbytes,
        gbps=nbytes / seconds / 1e9,
        intensity=intensity,
        frac_peak_tflops=flops / seconds / 1e12 / ceilings["ceiling_tflops"],
        frac_peak_bw=nbytes / seconds / 1e9 / ceilings["ceiling_gbps"],
        frac_roofline=flops / seconds / 1e12 / roof,
    )


# ------------------------------------------------------------------------------------------ output


def write_rows(rows: list[dict], machine: dict[str, object], out: Path, stem: str, columns) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in {**machine, **r}.items()})
    (out / f"{stem}.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")


def plot(rows: list[dict], out: Path, machine: dict[str, object]) -> list[Path]:
    """One PNG per (dtype, pass): a panel per (head dim, causal), TFLOP/s vs N, one line per provider."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots")
        return []
    paths = []
    ok = [r for r in rows if r.get("status") == "ok"]
    for dtype, pass_ in sorted({(r["dtype"], r["pass"]) for r in ok}):
        sub = [r for r in ok if r["dtype"] == dtype and r["pass"] == pass_]
        dims, causals = sorted({r["head_dim"] for r in sub}), sorted({r["causal"] for r in sub})
        fig, axes = plt.subplots(len(dims), len(causals), figsize=(5 * len(causals), 3.6 * len(dims)), squeeze=False)
        for (i, d), (j, c) in itertools.product(enumerate(dims), enumerate(causals)):
            ax = axes[i][j]
            for prov in sorted({r["provider"] for r in sub}):
                pts = sorted(
                    (r["seq_len"], r["tflops"])
                    for r in sub
                    if r["provider"] == prov and r["head_dim"] == d and r["causal"] == c
                )
                if pts:
                    ax.plot([n for n, _ in pts], [t for _, t in pts], marker="o", label=prov, color=COLORS.get(prov))
            ax.set_xscale("log", base=2)
            ax.set_title(f"{dtype} {pass_}, head dim {d}, {'causal' if c else 'not causal'}", fontsize=9)
            ax.set_xlabel("sequence length N (B*N = 16k)")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(
            f"{machine.get('gpu')}, torch {machine['torch']}, triton {machine['triton']}, {str(machine['date'])[:10]}",
            fontsize=9,
        )
        fig.tight_layout()
        path = out / f"tflops_{dtype}_{pass_.replace('+', '_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _fmt(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def summary(rows: list[dict], providers: list[str]) -> None:
    """TFLOP/s per cell and pass, a column per provider ('-' where it did not run)."""
    table = {}
    for r in rows:
        key = (r["dtype"], r["head_dim"], r["causal"], r["seq_len"], r["pass"])
        table.setdefault(key, {})[r["provider"]] = _fmt(float(r["tflops"])) if r.get("status") == "ok" else "-"
    print("\nTFLOP/s (FA convention; '-' = not run, see status in the CSV)")
    print_table(
        ["dtype", "D", "causal", "N", "pass", *providers],
        [
            [k[0], str(k[1]), "yes" if k[2] else "no", str(k[3]), k[4], *(v.get(p, "-") for p in providers)]
            for k, v in table.items()
        ],
    )


# -------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    default_out = Path(os.environ["OUT"]) / "bench" if os.environ.get("OUT") else HERE / "results" / "local" / "gpu"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trimmed", action="store_true", help="bf16, head dims 64 and 128, causal and not, N = 2k, 8k")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["bf16", "fp16"])
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    p.add_argument("--seq-lens", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument(
        "--causal",
        nargs="+",
        type=lambda s: s.lower() in ("1", "true", "yes", "causal"),
        default=[False, True],
        help="e.g. --causal true (default: both)",
    )
    p.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    p.add_argument(
        "--providers",
        nargs="+",
        help="subset of: triton triton-ptr triton-nows triton-det sdpa-flash sdpa-efficient sdpa-cudnn sdpa-math "
        "flash_attn dense (triton-nows: the forward without warp specialisation; triton-det: deterministic=True)",
    )
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms (default 25)")
    p.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms (default 100)")
    p.add_argument(
        "--max-dense-gib",
        type=float,
        default=40.0,
        help="skip dense/sdpa-math where their N x N matrices would exceed this (default 40)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=default_out,
        help="output directory ($OUT/bench if OUT is set, else benchmarks/results/local/gpu, untracked)",
    )
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if args.trimmed:
        args.dtypes, args.head_dims, args.seq_lens = ["bf16"], [64, 128], [2048, 8192]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cells = make_grid(args)
    import torch

    if not torch.cuda.is_available():
        print(
            "CUDA is absent (torch.cuda.is_available() is False): no GPU timings. "
            "The IO model of the grid, which needs no GPU, follows."
        )
        machine = machine_info()
        rows = iomodel_rows(cells)
        write_rows(rows, machine, args.out, "iomodel_grid", [*rows[0], "torch", "date"])
        print_table(
            ["dtype", "D", "causal", "N", "B", "H", "pass", "GFLOP", "tiled MiB", "standard MiB"],
            [
                [
                    r["dtype"],
                    str(r["head_dim"]),
                    "yes" if r["causal"] else "no",
                    str(r["seq_len"]),
                    str(r["batch"]),
                    str(r["heads"]),
                    r["pass"],
                    f"{r['gflop']:.1f}",
                    f"{r['tiled_mib']:.0f}",
                    f"{r['standard_mib']:.0f}",
                ]
                for r in rows
                if r["pass"] != "bwd"
            ],
        )
        print(f"wrote {args.out / 'iomodel_grid.csv'}")
        return 0

    machine = machine_info(gpu=True)
    print(
        f"{machine['gpu']} (driver {machine['driver']}, CUDA {machine['cuda_runtime']}), torch {machine['torch']}, "
        f"triton {machine['triton']}, {machine['date']}"
    )
    providers, missing = make_providers(args.providers)
    for name, why in missing.items():
        print(f"{name}: not available: {why}")
    ceilings = measure_ceilings(args.warmup, args.rep)
    torch.cuda.empty_cache()
    print(
        f"ceilings: bf16 matmul {ceilings['ceiling_tflops']:.0f} TFLOP/s, device copy "
        f"{ceilings['ceiling_gbps']:.0f} GB/s"
    )
    rows = []
    start = time.perf_counter()
    for n, cell in enumerate(cells, 1):
        print(
            f"[{n}/{len(cells)} {time.perf_counter() - start:5.0f} s] {cell.dtype} D={cell.head_dim} "
            f"causal={cell.causal} N={cell.seq_len} B={cell.batch} H={cell.heads}",
            flush=True,
        )
        for provider in providers:
            for row in run_cell(cell, provider, args):
                add_roofline(row, ceilings)
                rows.append(row)
                if row["status"] != "ok" and row["pass"] == args.passes[0]:
                    print(f"    {provider.name}: {row['status']}")
        write_rows(rows, machine, args.out, "attention", CSV_COLUMNS)  # after every cell: a timeout keeps them
    print(f"wrote {args.out / 'attention.csv'} and {args.out / 'attention.json'}")
    if not args.no_plot:
        for path in plot(rows, args.out, machine):
            print(f"wrote {path}")
    summary(rows, [p.name for p in providers])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
