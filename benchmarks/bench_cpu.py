"""CPU time and peak memory of the references against torch's SDPA.

    python benchmarks/bench_cpu.py                 # full grid: N = 1k..16k, D = 64, float32 (minutes)
    python benchmarks/bench_cpu.py --quick         # small sizes, seconds
    python benchmarks/bench_cpu.py --targets       # the issues' speed and memory ratios, idle and loaded
    python benchmarks/bench_cpu.py --small-calls   # only the small-call rows of --targets (about a minute)
    python benchmarks/bench_cpu.py --out DIR       # cpu.csv, cpu.json, cpu.png (default benchmarks/results/local/cpu)

Every measurement runs in its own subprocess, so ``ru_maxrss`` (the process's peak resident memory) belongs
to that one measurement. "Added" memory is that peak minus the peak of an idle process that imported the
same modules, built the same inputs and ran every implementation once at a tiny size (the baseline).
Times are the median of repeated calls after one warm-up call, with torch's default (all-core) threading.
The ``--targets`` speed ratios of the threaded path are measured differently: ours and torch's SDPA called
in turn in one process, medians of each, once with the machine otherwise idle and once "loaded", while a
child process spins on the last core (see benchmarks/README.md). The small-call rows (``--small-calls``;
also part of ``--targets``) time single calls of microseconds: per-call medians of ours and torch's SDPA,
measured in alternating blocks in one process per condition, and the host overhead of options + plan.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_info

HERE = Path(__file__).resolve().parent
IMPLS = ("dense", "online", "key_major", "parallel", "sdpa")
MODES = ("fwd", "fwd+bwd")
CONDITIONS = ("idle", "loaded")  # loaded: a child process spins on the last core during the measurement
FLOP_FACTOR = {"fwd": 1.0, "fwd+bwd": 3.5}  # 4*B*H*N^2*D forward; backward 2.5x (FlashAttention convention)
CSV_COLUMNS = (
    "impl",
    "mode",
    "batch",
    "heads",
    "seq_len",
    "head_dim",
    "dtype",
    "threads",
    "repeats",
    "time_ms",
    "time_min_ms",
    "gflops",
    "peak_rss_mib",
    "baseline_rss_mib",
    "added_mib",
    "status",
    "cpu",
    "torch",
    "date",
)
# Dense attention keeps a few N x N float32 matrices alive at once (S, its masked copy, P; and their
# gradients in the backward); these factors over-estimate its peak so the grid can skip cells that
# would not fit.
DENSE_MATRICES = {"fwd": 6, "fwd+bwd": 10}


# ------------------------------------------------------------------------------------------ worker


def _maxrss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _attention(impl: str):
    import torch.nn.functional as F

    from flashattn_teach import dense_attention, key_major_attention, online_attention

    if impl == "parallel":
        return _parallel_attention()
    return {
        "dense": dense_attention,
        "online": online_attention,
        "key_major": key_major_attention,
        "sdpa": F.scaled_dot_product_attention,
    }[impl]


def _parallel_attention():
    """``(B, H, N, D)`` attention through ``reference/parallel.py`` with its default tiles and workers.

    The grouped layout with one query head per key/value head is a view (``G = 1`` at dim 2), so a small
    autograd.Function calls ``parallel_forward`` and ``parallel_backward`` directly.
    """
    import torch

    from flashattn_teach._options import make_options
    from flashattn_teach.reference.defaults import PARALLEL_BLOCK_M, PARALLEL_BLOCK_N
    from flashattn_teach.reference.parallel import parallel_backward, parallel_forward
    from flashattn_teach.reference.workers import default_workers

    class ParallelAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            qg, kg, vg = q[:, :, None], k[:, :, None], v[:, :, None]  # (B, H, 1, N, D): grouped, G = 1
            # the call's mask contract at the parallel path's tiles (grouped tensors are valid 5-D inputs)
            tiling = make_options(qg, kg, vg).mask.tiling(PARALLEL_BLOCK_M, PARALLEL_BLOCK_N)
            scale = q.shape[-1] ** -0.5
            O, lse = parallel_forward(qg, kg, vg, scale=scale, tiling=tiling, workers=default_workers())
            ctx.save_for_backward(q, k, v, O, lse)
            ctx.tiling = tiling
            return O[:, :, 0]

        @staticmethod
        def backward(ctx, dO):
            q, k, v, O, lse = ctx.saved_tensors
            qg, kg, vg, dOg = q[:, :, None], k[:, :, None], v[:, :, None], dO[:, :, None]
            scale = q.shape[-1] ** -0.5
            dq, dk, dv = parallel_backward(
                qg, kg, vg, O, lse, dOg, None, scale=scale, tiling=ctx.tiling, workers=default_workers()
            )
            return dq[:, :, 0], dk[:, :, 0], dv[:, :, 0]

    return ParallelAttention.apply


def _call(fn, q, k, v, mode: str, dO) -> None:
    out = fn(q, k, v)
    if mode == "fwd+bwd":
        out.backward(dO)
        for t in (q, k, v):
            t.grad = None


def worker(args: argparse.Namespace) -> dict[str, object]:
    """One measurement (or, with ``impl == "idle"``, the baseline) in this process."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    grad = args.mode == "fwd+bwd"
    impls = IMPLS if args.impl == "idle" else (args.impl,)
    # Lazy initialisation (thread pools, allocator caches, autograd engine) happens at a tiny size, in the
    # measured process and in the baseline alike, so "added" memory is what the large call needs.
    for impl in impls:
        tiny = [torch.randn(1, 1, 64, args.head_dim, requires_grad=grad) for _ in range(3)]
        _call(_attention(impl), *tiny, args.mode, torch.randn(1, 1, 64, args.head_dim))
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq_len, args.head_dim)
    q, k, v, dO = (torch.randn(shape, generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(grad)
    row: dict[str, object] = {"threads": torch.get_num_threads()}
    if args.impl == "idle":
        return {**row, "peak_rss_mib": _maxrss_mib()}
    fn = _attention(args.impl)
    with torch.no_grad() if not grad else torch.enable_grad():
        start = time.perf_counter()
        _call(fn, q, k, v, args.mode, dO)  # warm-up, and the first estimate of one call's time
        first = time.perf_counter() - start
        repeats = max(1, min(args.max_repeats, math.ceil(args.min_time / max(first, 1e-6))))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            _call(fn, q, k, v, args.mode, dO)
            times.append(time.perf_counter() - start)
    times.sort()
    return {
        **row,
        "repeats": repeats,
        "time_ms": 1e3 * times[len(times) // 2],
        "time_min_ms": 1e3 * times[0],
        "peak_rss_mib": _maxrss_mib(),
    }


def _busy_seconds() -> tuple[float, float]:
    """CPU seconds all processes have run since boot, from Linux's /proc/stat (NaN elsewhere): at normal or
    raised priority (user, system, irq, softirq), and niced (user time of processes with nice > 0)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[1:8])
    except (OSError, ValueError):
        return math.nan, math.nan
    tick = os.sysconf("SC_CLK_TCK")
    return (user + system + irq + softirq) / tick, nice / tick


def paired_worker(args: argparse.Namespace) -> dict[str, object]:
    """``args.impl`` and ``args.against`` called in turn on the same inputs, so both see the same machine:
    median time of each, their ratio, and how many cores other processes kept busy meanwhile."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    grad = args.mode == "fwd+bwd"
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq_len, args.head_dim)
    q, k, v, dO = (torch.randn(shape, generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(grad)
    fns = {name: _attention(name) for name in (args.impl, args.against)}
    times: dict[str, list[float]] = {name: [] for name in fns}
    loadavg = os.getloadavg()[0]
    with torch.no_grad() if not grad else torch.enable_grad():
        for fn in fns.values():
            _call(fn, q, k, v, args.mode, dO)  # warm-up (starts the worker threads)
        (busy, niced), own, wall = _busy_seconds(), time.process_time(), time.perf_counter()
        rounds = 0
        while rounds < args.min_rounds or (
            rounds < args.max_repeats and min(sum(ts) for ts in times.values()) < args.min_time
        ):
            for name, fn in fns.items():
                start = time.perf_counter()
                _call(fn, q, k, v, args.mode, dO)
                times[name].append(time.perf_counter() - start)
            rounds += 1
        wall = time.perf_counter() - wall
        # All processes' CPU time minus this one's (every thread), per second: other processes' busy cores.
        # Niced ones are counted apart: they get a small share of a core that this process also wants.
        busy_end, niced_end = _busy_seconds()
        others = (busy_end - busy - (time.process_time() - own)) / wall
        # /proc/stat counts 10 ms ticks, the process clock nanoseconds: clamp the small negatives of rounding.
        others = others if math.isnan(others) else max(0.0, others)
        others_niced = (niced_end - niced) / wall
    ours, theirs = (statistics.median(times[name]) for name in fns)
    return {
        "threads": torch.get_num_threads(),
        "repeats": rounds,
        "time_ms": 1e3 * ours,
        "time_min_ms": 1e3 * min(times[args.impl]),
        f"{args.against}_time_ms": 1e3 * theirs,
        f"{args.against}_time_min_ms": 1e3 * min(times[args.against]),
        "ratio": ours / theirs,
        "others_cores": others,
        "others_niced_cores": others_niced,
        "loadavg_1m": loadavg,
    }


# ------------------------------------------------------------------------------------------ driver


def _spawn(cell: dict[str, object], opts: argparse.Namespace, extra: tuple[str, ...] = ()) -> dict[str, object]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--impl",
        str(cell["impl"]),
        "--mode",
        str(cell["mode"]),
        "--batch",
        str(cell["batch"]),
        "--heads",
        str(cell["heads"]),
        "--seq-len",
        str(cell["seq_len"]),
        "--head-dim",
        str(cell["head_dim"]),
        "--min-time",
        str(opts.min_time),
        "--max-repeats",
        str(opts.max_repeats),
        "--threads",
        str(opts.threads),
        *extra,
    ]
    return _run_worker(cmd, opts)


def _run_worker(cmd: list[str], opts: argparse.Namespace) -> dict[str, object]:
    """Run a worker command with this checkout's ``src`` first on the path; its last stdout line is JSON."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent / "src"), os.environ.get("PYTHONPATH")])),
    }
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.cell_timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout after {opts.cell_timeout:g} s"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": f"error (rc {proc.returncode}): {last[:200]}"}
    return {"status": "ok", **json.loads(proc.stdout.strip().splitlines()[-1])}


@contextlib.contextmanager
def _spinner(on: bool):
    """While the block runs, a child process spinning on the last core (the "loaded" condition)."""
    if not on:
        yield
        return
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(spin.pid, {max(os.sched_getaffinity(0))})
        time.sleep(0.5)  # spinning before the measurement process starts
        yield
    finally:
        spin.kill()
        spin.wait()


def measure_paired(cells: list[dict[str, object]], opts: argparse.Namespace, machine: dict[str, object]) -> list[dict]:
    """Each cell (with a ``condition``) in its own process, ``cell["impl"]`` against torch's SDPA in turn;
    two rows per cell, ours (with the ratio) and SDPA's."""
    rows = []
    for cell in cells:
        print(f"{cell['impl']} and sdpa in turn: {cell['mode']}, {cell['condition']}", file=sys.stderr, flush=True)
        with _spinner(cell["condition"] == "loaded"):
            result = _spawn(cell, opts, extra=("--against", "sdpa", "--min-rounds", str(opts.min_rounds)))
        flops = _flops(cell)
        run = dict(cpu=machine["cpu"], torch=machine["torch"], date=machine["date"])
        ours = {**cell, "dtype": "float32", **result, **run}
        theirs = {**cell, "impl": "sdpa", "dtype": "float32", "status": result["status"], **run}
        if result["status"] == "ok":
            ours["gflops"] = flops / (float(ours["time_ms"]) * 1e-3) / 1e9
            theirs.update(
                threads=result["threads"],
                repeats=result["repeats"],
                time_ms=result["sdpa_time_ms"],
                time_min_ms=result["sdpa_time_min_ms"],
                gflops=flops / (float(result["sdpa_time_ms"]) * 1e-3) / 1e9,
                others_cores=result["others_cores"],
                others_niced_cores=result["others_niced_cores"],
            )
        rows += [ours, theirs]
    return rows


def _flops(cell: dict[str, object]) -> float:
    B, H, N, D = (int(str(cell[key])) for key in ("batch", "heads", "seq_len", "head_dim"))
    return 4 * B * H * N**2 * D * FLOP_FACTOR[str(cell["mode"])]


def _dense_estimate_gib(cell: dict[str, object]) -> float:
    n2 = int(cell["batch"]) * int(cell["heads"]) * int(cell["seq_len"]) ** 2
    return DENSE_MATRICES[str(cell["mode"])] * n2 * 4 / 2**30


def measure(cells: list[dict[str, object]], opts: argparse.Namespace, machine: dict[str, object]) -> list[dict]:
    """Run each cell (and one baseline per shape and mode) in its own process, with a progress bar."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    shapes = sorted(
        {(c["mode"], c["batch"], c["heads"], c["seq_len"], c["head_dim"]) for c in cells},
        key=lambda s: (s[3], str(s[0])),
    )
    baselines: dict[tuple, float] = {}
    rows = []
    with Progress(
        TextColumn("{task.description:<44}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        transient=not sys.stderr.isatty(),
    ) as progress:
        task = progress.add_task("CPU benchmark", total=len(cells) + len(shapes))
        for shape in shapes:
            mode, seq_len = shape[0], shape[3]
            for cell in (c for c in cells if (c["mode"], c["batch"], c["heads"], c["seq_len"], c["head_dim"]) == shape):
                if cell["impl"] == "dense" and _dense_estimate_gib(cell) > opts.max_dense_gib:
                    result = {"status": f"skipped: dense needs ~{_dense_estimate_gib(cell):.0f} GiB"}
                else:
                    if shape not in baselines:  # one idle process per shape and mode, before its first cell
                        progress.update(task, description=f"baseline  {mode:<7} N={seq_len}")
                        base = _spawn({**cell, "impl": "idle"}, opts)
                        baselines[shape] = float(base.get("peak_rss_mib", math.nan))
                    progress.update(task, description=f"{cell['impl']:<9} {mode:<7} N={seq_len}")
                    result = _spawn(cell, opts)
                row = {**cell, "dtype": "float32", **result, "baseline_rss_mib": baselines.get(shape, math.nan)}
                if result["status"] == "ok":
                    row["added_mib"] = max(0.0, float(row["peak_rss_mib"]) - baselines[shape])
                    row["gflops"] = _flops(cell) / (float(row["time_ms"]) * 1e-3) / 1e9
                row.update(cpu=machine["cpu"], torch=machine["torch"], date=machine["date"])
                rows.append(row)
                progress.advance(task)
            progress.advance(task)  # the baseline's step, run or not needed
    return rows


def write_results(rows: list[dict], machine: dict[str, object], out: Path, stem: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in row.items()})
    (out / f"{stem}.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")


def _label(row: dict) -> str:
    """The impl, and the condition of a paired measurement: ``parallel (loaded)``."""
    return f"{row['impl']} ({row['condition']})" if "condition" in row else str(row["impl"])


def _cell(row: dict, key: str, fmt: str = ".1f") -> str:
    """A number of the row for a table, or ``-`` where the cell did not run or did not measure it."""
    return format(row[key], fmt) if row["status"] == "ok" and key in row else "-"


def write_summary(rows: list[dict], machine: dict[str, object], path: Path, extra: str = "") -> None:
    """A markdown table of the run, with its machine, ready to paste into benchmarks/README.md."""
    lines = [
        f"{machine['cpu']}, {machine['cpu_count']} cores, {machine['ram_gib']} GiB RAM; torch {machine['torch']}, "
        f"Python {machine['python']}; commit {machine['flashattn_teach_commit']}; {machine['date']}.",
        "",
        "| impl | mode | B | H | N | D | time (ms) | GFLOP/s | added memory (MiB) | status |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        cells = [
            _label(r),
            r["mode"],
            r["batch"],
            r["heads"],
            r["seq_len"],
            r["head_dim"],
            _cell(r, "time_ms"),
            _cell(r, "gflops"),
            _cell(r, "added_mib"),
            r["status"],
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    path.write_text("\n".join(lines) + "\n" + (f"\n{extra}\n" if extra else ""))


def plot(rows: list[dict], out: Path, title: str) -> Path | None:
    """Peak added memory vs N (log-log, with N and N^2 guide slopes) and time vs N, one line per impl/mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = dict(zip(IMPLS, ("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:gray"), strict=True))
    ns_all = sorted({int(r["seq_len"]) for r in rows})
    for impl in IMPLS:
        for mode, style in zip(MODES, ("-", "--"), strict=True):
            ok = sorted(
                (int(r["seq_len"]), r) for r in rows if r["impl"] == impl and r["mode"] == mode and r["status"] == "ok"
            )
            if not ok:
                continue
            ns = [n for n, _ in ok]
            ax_mem.plot(
                ns,
                [max(r["added_mib"], 1e-1) for _, r in ok],
                style,
                marker="o",
                color=colors[impl],
                label=f"{impl} {mode}",
            )
            ax_time.plot(
                ns, [r["time_ms"] for _, r in ok], style, marker="o", color=colors[impl], label=f"{impl} {mode}"
            )
    dense = [r for r in rows if r["impl"] == "dense" and r["mode"] == "fwd" and r["status"] == "ok"]
    if dense and len(ns_all) > 1:
        n0, m0 = int(dense[0]["seq_len"]), max(dense[0]["added_mib"], 1e-1)
        ax_mem.plot(ns_all, [m0 * (n / n0) ** 2 for n in ns_all], ":", color="black", lw=1, label="slope 2 (N^2)")
        ax_mem.plot(ns_all, [m0 / 8 * (n / n0) for n in ns_all], "-.", color="black", lw=1, label="slope 1 (N)")
    for ax, ylabel in ((ax_mem, "peak memory added (MiB)"), (ax_time, "time per call (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_mem.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = out / "cpu.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="CPU attention, float32 (time: median ms; memory: peak MiB added over baseline)")
    for col in ("impl", "mode", "B", "H", "N", "D", "time ms", "GFLOP/s", "added MiB", "status"):
        table.add_column(col, justify="left" if col in ("impl", "mode", "status") else "right")
    for r in rows:
        table.add_row(
            _label(r),
            str(r["mode"]),
            str(r["batch"]),
            str(r["heads"]),
            str(r["seq_len"]),
            str(r["head_dim"]),
            _cell(r, "time_ms"),
            _cell(r, "gflops"),
            _cell(r, "added_mib"),
            str(r["status"]),
        )
    Console(width=140).print(table)


# ----------------------------------------------------------------------------------------- targets


TARGET_SIZES = {"speed_heads": 8, "speed_n": 4096, "memory_fwd_n": 16384, "memory_fwdbwd_n": 8192}
# Average busy cores of other processes at normal priority above which an "idle" paired row is not idle.
IDLE_OTHERS_MAX = 0.3


def run_targets(opts: argparse.Namespace, machine: dict[str, object], sizes: dict[str, int] = TARGET_SIZES) -> list:
    """The CPU targets (D = 64, float32, B = 1). Foundation issue: (a) online forward at most 2.5x torch's
    SDPA and faster than dense (H = 8, N = 4096); (b) online adds at most 1/20 of dense's peak memory in the
    forward at N = 16384 and at most 1/10 in forward+backward at N = 8192 (H = 1). Issue #8: (c) the threaded
    path's forward and forward+backward at most 2x SDPA (H = 8, N = 4096), idle and loaded, each ratio from
    one process that calls both in turn; (d) its memory, as (b)."""
    hs, ns, nf, nfb = sizes["speed_heads"], sizes["speed_n"], sizes["memory_fwd_n"], sizes["memory_fwdbwd_n"]
    speed = [dict(impl=i, mode="fwd", batch=1, heads=hs, seq_len=ns, head_dim=64) for i in ("online", "sdpa", "dense")]
    memory = [
        dict(impl=i, mode=m, batch=1, heads=1, seq_len=n, head_dim=64)
        for m, n in (("fwd", nf), ("fwd+bwd", nfb))
        for i in ("online", "parallel", "dense")
    ]
    paired = [
        dict(impl="parallel", mode=m, batch=1, heads=hs, seq_len=ns, head_dim=64, condition=c)
        for c in CONDITIONS
        for m in MODES
    ]
    rows = measure(speed + memory, opts, machine)
    paired_rows = measure_paired(paired, opts, machine)

    def ratio(impl: str, mode: str, n: int, key: str, other: str) -> float:
        def get(impl: str) -> float:
            row = next(
                r
                for r in rows
                if r["impl"] == impl and r["mode"] == mode and r["seq_len"] == n and "condition" not in r
            )
            return float(row[key]) if row["status"] == "ok" else math.nan

        denominator = get(other)
        return get(impl) / denominator if denominator else math.nan  # too small to measure: no ratio

    def paired_ratio(mode: str, condition: str) -> float:
        row = next(
            r for r in paired_rows if r["impl"] == "parallel" and (r["mode"], r["condition"]) == (mode, condition)
        )
        return float(row["ratio"]) if row["status"] == "ok" else math.nan

    small_checks, small_rows = measure_small_calls(opts)
    checks = [  # (what, measured ratio, bound, inclusive, unit)
        (f"online / sdpa, fwd time (H={hs}, N={ns})", ratio("online", "fwd", ns, "time_ms", "sdpa"), 2.5, True, "x"),
        (f"online / dense, fwd time (H={hs}, N={ns})", ratio("online", "fwd", ns, "time_ms", "dense"), 1.0, False, "x"),
        *(
            (
                f"{impl} / dense, {mode} added memory (H=1, N={n})",
                ratio(impl, mode, n, "added_mib", "dense"),
                b,
                True,
                "x",
            )
            for impl in ("online", "parallel")
            for mode, n, b in (("fwd", nf, 1 / 20), ("fwd+bwd", nfb, 1 / 10))
        ),
        *(
            (f"parallel / sdpa, {mode} time, {c} (H={hs}, N={ns})", paired_ratio(mode, c), 2.0, True, "x")
            for mode in MODES
            for c in CONDITIONS
        ),
        *small_checks,
    ]
    rows += paired_rows
    print_table(rows)
    results, lines = _check_lines(checks)
    lines += ["", *_paired_lines(paired_rows), "", *_small_lines(small_rows)]
    print("\n".join(_paired_lines(paired_rows)))
    print("\n".join(_small_lines(small_rows)))
    opts.out.mkdir(parents=True, exist_ok=True)
    write_summary(rows, machine, opts.out / "targets.md", extra="\n".join(lines))
    (opts.out / "cpu_targets.json").write_text(
        json.dumps({"machine": machine, "targets": results, "rows": rows, "small_calls": small_rows}, indent=1) + "\n"
    )
    print(f"wrote {opts.out / 'cpu_targets.json'} and {opts.out / 'targets.md'}")
    return results


def _paired_lines(rows: list[dict]) -> list[str]:
    """The paired measurements, with how busy the rest of the machine was, and a warning where an "idle"
    row was not."""
    lines = [
        "| mode | condition | parallel (ms) | sdpa (ms) | ratio | rounds | others (cores) | niced (cores) | load avg |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    busy = []
    for r in (r for r in rows if r["impl"] == "parallel"):
        lines.append(
            f"| {r['mode']} | {r['condition']} | {_cell(r, 'time_ms')} | {_cell(r, 'sdpa_time_ms')} | "
            f"{_cell(r, 'ratio', '.3f')} | {_cell(r, 'repeats', 'd')} | {_cell(r, 'others_cores', '.2f')} | "
            f"{_cell(r, 'others_niced_cores', '.2f')} | {_cell(r, 'loadavg_1m', '.2f')} |"
        )
        if r["condition"] == "idle" and r["status"] == "ok" and float(r["others_cores"]) > IDLE_OTHERS_MAX:
            busy.append(f"{r['mode']} ({float(r['others_cores']):.2f} cores)")
    if busy:
        lines += ["", f"WARNING: other processes were busy during the idle rows: {', '.join(busy)}; not idle."]
    return lines


# ------------------------------------------------------------------------------------- small calls


# The small-call targets: (key, what, bound, unit). "x": ours / torch's SDPA on the same tensors, both
# medians of per-call times from one process; "us": the median per-call host overhead in microseconds.
SMALL_CALLS = (
    ("flash_attention", "flash_attention / sdpa, (1, 8, 16, 64)", 3.0, "x"),
    ("scaled_dot_product_attention", "scaled_dot_product_attention / sdpa, (1, 8, 16, 64)", 3.0, "x"),
    ("kvcache_decode", "flash_attention_with_kvcache / sdpa, decode q (1, 8, 1, 64), 512 cached keys", 3.0, "x"),
    ("flash_attention_128", "flash_attention / sdpa, (B, H, N_q, N_k, D) = (2, 8, 128, 128, 64)", 1.5, "x"),
    ("host_overhead", "make_options + dispatch.plan, (1, 8, 16, 64)", 30.0, "us"),
)


def _small_cases():
    """``{key: (ours, sdpa or None)}``: argument-free callables on fixed float32 inputs (seeded)."""
    import torch
    import torch.nn.functional as F

    import flashattn_teach

    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int):
        return torch.randn(shape, generator=gen)

    q, k, v = randn(1, 8, 16, 64), randn(1, 8, 16, 64), randn(1, 8, 16, 64)
    qd, kc, vc = randn(1, 8, 1, 64), randn(1, 8, 512, 64), randn(1, 8, 512, 64)
    kc512, vc512 = kc[:, :, :512], vc[:, :, :512]  # the same 512 keys, sliced once outside the timed call
    ql, kl, vl = randn(2, 8, 128, 64), randn(2, 8, 128, 64), randn(2, 8, 128, 64)
    cases = {
        "flash_attention": (
            lambda: flashattn_teach.flash_attention(q, k, v),
            lambda: F.scaled_dot_product_attention(q, k, v),
        ),
        "scaled_dot_product_attention": (
            lambda: flashattn_teach.scaled_dot_product_attention(q, k, v),
            lambda: F.scaled_dot_product_attention(q, k, v),
        ),
        "kvcache_decode": (
            lambda: flashattn_teach.flash_attention_with_kvcache(qd, kc, vc, cache_seqlens=512),
            lambda: F.scaled_dot_product_attention(qd, kc512, vc512),
        ),
        "flash_attention_128": (
            lambda: flashattn_teach.flash_attention(ql, kl, vl),
            lambda: F.scaled_dot_product_attention(ql, kl, vl),
        ),
    }
    try:  # the library's internal layout: options built once, then dispatch.plan chooses the backend
        from flashattn_teach._options import make_options
        from flashattn_teach.dispatch import plan

        cases["host_overhead"] = (lambda: plan(q, k, v, make_options(q, k, v)), None)
    except ImportError as e:
        cases["host_overhead"] = (None, f"skipped: {e}")  # type: ignore[assignment]
    return cases


# The small calls' clocks: "wall" (time.perf_counter), or "thread" (time.thread_time: the CPU time of the
# calling thread, which a descheduled thread does not accrue; with --threads 1 that is all of a call's CPU
# time, so the ratio stays readable on a machine other processes load).
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def _time_calls(fn, n: int, times: list[float], clock=time.perf_counter) -> int:
    """``n`` timed calls of ``fn``; returns the minor page faults they took (fresh pages the kernel zeroed:
    a call whose large temporaries glibc hands back to the system between calls pays them every time)."""
    faults = _minor_faults()
    for _ in range(n):
        start = clock()
        fn()
        times.append(clock() - start)
    return _minor_faults() - faults


def _minor_faults() -> int:
    try:
        import resource
    except ImportError:  # not on Windows
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def small_worker(args: argparse.Namespace) -> dict[str, object]:
    """Every small-call case in this process: ``args.warmup`` calls of each, then ``args.calls`` timed calls
    of each in blocks of ``args.block``, ours and SDPA's blocks alternating (and which goes first swapping
    every block pair), so drift hits both; per-call medians, their ratio, and other processes' busy cores."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    with torch.no_grad():
        for key, (ours, theirs) in _small_cases().items():
            if ours is None:
                rows.append({"case": key, "status": str(theirs)})
                continue
            fns = {"ours": ours, **({"sdpa": theirs} if callable(theirs) else {})}
            row: dict[str, object] = {"case": key, "status": "ok", "calls": args.calls, "warmup": args.warmup}
            try:
                outs = {name: fn() for name, fn in fns.items()}
                if "sdpa" in outs:  # both compute the same attention
                    row["max_err"] = float((outs["ours"] - outs["sdpa"]).abs().max())
                clock = CLOCKS[args.clock]
                for fn in fns.values():
                    _time_calls(fn, args.warmup, [], clock)
                times: dict[str, list[float]] = {name: [] for name in fns}
                faults = dict.fromkeys(fns, 0)
                (busy, niced), own, wall = _busy_seconds(), time.process_time(), time.perf_counter()
                order = list(fns)
                for b in range(math.ceil(args.calls / args.block)):
                    n = min(args.block, args.calls - b * args.block)
                    for name in order if b % 4 < 2 else order[::-1]:  # ours, sdpa, ours, sdpa; sdpa, ours, ...
                        faults[name] += _time_calls(fns[name], n, times[name], clock)
                wall = time.perf_counter() - wall
                busy_end, niced_end = _busy_seconds()
                others = (busy_end - busy - (time.process_time() - own)) / wall
                row["others_cores"] = others if math.isnan(others) else max(0.0, others)
                row["others_niced_cores"] = (niced_end - niced) / wall
            except Exception as e:  # a case that fails is a row with its error; the others still run
                rows.append({"case": key, "status": f"error: {type(e).__name__}: {str(e)[:200]}"})
                continue
            for name, ts in times.items():
                row[f"{name}_us"] = 1e6 * statistics.median(ts)
                row[f"{name}_min_us"] = 1e6 * min(ts)
                row[f"{name}_faults"] = faults[name] / len(ts)  # minor page faults per call
            if "sdpa" in times:
                row["ratio"] = float(row["ours_us"]) / float(row["sdpa_us"])  # type: ignore[arg-type]
            rows.append(row)
    return {"threads": torch.get_num_threads(), "loadavg_1m": os.getloadavg()[0], "rows": rows}


def measure_small_calls(opts: argparse.Namespace) -> tuple[list[tuple[str, float, float, bool, str]], list[dict]]:
    """The small-call cases, idle and loaded (one process per condition): the checks for the targets
    table (what, value, bound, inclusive, unit) and one row per case and condition."""
    rows: list[dict] = []
    for condition in opts.small_conditions:
        print(f"small calls, ours and sdpa in alternating blocks: {condition}", file=sys.stderr, flush=True)
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--small-worker",
            *("--calls", str(opts.calls), "--warmup", str(opts.warmup), "--block", str(opts.block)),
            *("--threads", str(opts.threads), "--clock", opts.clock),
        ]
        with _spinner(condition == "loaded"):
            result = _run_worker(cmd, opts)
        if result["status"] != "ok":
            rows += [{"case": key, "condition": condition, "status": result["status"]} for key, *_ in SMALL_CALLS]
            continue
        extra = {"condition": condition, "threads": result["threads"], "loadavg_1m": result["loadavg_1m"]}
        rows += [{**r, **extra} for r in result["rows"]]  # type: ignore[attr-defined]
    checks = []
    for key, what, bound, unit in SMALL_CALLS:
        for condition in opts.small_conditions:
            row = next(r for r in rows if (r["case"], r["condition"]) == (key, condition))
            value = row.get("ratio" if unit == "x" else "ours_us", math.nan) if row["status"] == "ok" else math.nan
            checks.append((f"{what}, {condition}", float(value), bound, True, unit))
    return checks, rows


def _small_lines(rows: list[dict]) -> list[str]:
    """The small-call measurements, with how busy the rest of the machine was."""
    lines = [
        "| small call | condition | ours (µs) | sdpa (µs) | ratio | calls | max err | page faults a call (ours / sdpa) "
        "| others (cores) | load avg |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    busy = []
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['condition']} | {_cell(r, 'ours_us')} | {_cell(r, 'sdpa_us')} | "
            f"{_cell(r, 'ratio', '.3f')} | {_cell(r, 'calls', 'd')} | {_cell(r, 'max_err', '.1e')} | "
            f"{_cell(r, 'ours_faults', '.1f')} / {_cell(r, 'sdpa_faults', '.1f')} | "
            f"{_cell(r, 'others_cores', '.2f')} | {_cell(r, 'loadavg_1m', '.2f')} |"
            + ("" if r["status"] == "ok" else f" {r['status']}")
        )
        if r["condition"] == "idle" and r["status"] == "ok" and float(r["others_cores"]) > IDLE_OTHERS_MAX:
            busy.append(f"{r['case']} ({float(r['others_cores']):.2f} cores)")
    if busy:
        lines += ["", f"WARNING: other processes were busy during the idle rows: {', '.join(busy)}; not idle."]
    return lines


def _check_lines(checks: list[tuple[str, float, float, bool, str]]) -> tuple[list[dict], list[str]]:
    """Each check as a JSON record and a markdown table line (printed as MET / NOT MET too)."""
    results, lines = [], ["| target | ratio (or µs) | bound | met |", "|---|--:|--:|---|"]
    for name, value, limit, inclusive, unit in checks:
        met = value <= limit if inclusive else value < limit  # False for NaN (a cell that did not run)
        suffix = " µs" if unit == "us" else ""
        bound = f"{'<=' if inclusive else '<'} {limit:.4g}{suffix}"
        results.append({"target": name, "ratio": value, "unit": unit, "bound": bound, "met": bool(met)})
        shown = f"{value:.2f} µs" if unit == "us" else f"{value:.4f}"
        lines.append(f"| {name} | {shown} | {bound} | {'yes' if met else 'NO'} |")
        print(f"{'MET    ' if met else 'NOT MET'}  {name}: {shown}  (bound {bound})")
    return results, lines


def run_small_calls(opts: argparse.Namespace, machine: dict[str, object]) -> list:
    """Only the small-call rows of the targets: ``small_calls.md`` and ``cpu_small_calls.json`` (so a full
    ``--targets`` run's ``targets.md`` in the same directory is left as it was)."""
    checks, rows = measure_small_calls(opts)
    results, lines = _check_lines(checks)
    small = _small_lines(rows)
    print("\n".join(small))
    opts.out.mkdir(parents=True, exist_ok=True)
    head = (
        f"{machine['cpu']}, {machine['cpu_count']} cores; torch {machine['torch']}, Python {machine['python']}; "
        f"commit {machine['flashattn_teach_commit']}; {machine['date']}. float32, medians of {opts.calls} "
        f"calls after {opts.warmup} warm-up calls, ours and sdpa in alternating blocks of {opts.block}; "
        f"clock: {opts.clock}, torch threads: {opts.threads or 'default'}."
    )
    command = "python benchmarks/bench_cpu.py " + " ".join(opts.argv)  # to rerun these rows
    rerun = f"Rerun: `{command}`"
    (opts.out / "small_calls.md").write_text("\n".join([head, "", rerun, "", *lines, "", *small]) + "\n")
    (opts.out / "cpu_small_calls.json").write_text(
        json.dumps({"machine": machine, "command": command, "targets": results, "small_calls": rows}, indent=1) + "\n"
    )
    print(f"wrote {opts.out / 'cpu_small_calls.json'} and {opts.out / 'small_calls.md'}")
    return results


# -------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes (N = 256, 512; H = 2): seconds")
    p.add_argument("--targets", action="store_true", help="measure the foundation issue's CPU targets only")
    p.add_argument(
        "--small-calls",
        action="store_true",
        help="only the small-call target rows (idle and loaded, about a minute): small_calls.md, cpu_small_calls.json",
    )
    p.add_argument("--calls", type=int, default=200, help="small calls: timed calls of each (default 200)")
    p.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="wall",
        help="small calls: wall time, or the calling thread's CPU time (with --threads 1: robust to load)",
    )
    p.add_argument("--warmup", type=int, default=20, help="small calls: warm-up calls of each (default 20)")
    p.add_argument("--block", type=int, default=10, help="small calls: calls per alternating block (default 10)")
    p.add_argument(
        "--small-conditions",
        nargs="+",
        choices=CONDITIONS,
        default=list(CONDITIONS),
        help="small calls: idle and/or loaded (default both)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=HERE / "results" / "local" / "cpu",
        help="output directory (default benchmarks/results/local/cpu, untracked; the committed results were "
        "written with --out benchmarks/results/cpu)",
    )
    p.add_argument("--sizes", type=int, nargs="+", help="sequence lengths N (default 1024 .. 16384)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS), help="implementations to measure")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="fwd and/or fwd+bwd")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=None, help="heads H (default 4; 2 with --quick)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument(
        "--min-time",
        type=float,
        default=None,
        help="repeat each call until this many seconds are spent (default 2; 0.05 with --quick)",
    )
    p.add_argument("--max-repeats", type=int, default=20)
    p.add_argument(
        "--min-rounds",
        type=int,
        default=5,
        help="--targets: at least this many calls of each in the paired (ours, then SDPA) measurements",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (default 0: torch's default, all cores)")
    p.add_argument(
        "--max-dense-gib",
        type=float,
        default=12.0,
        help="skip dense cells whose estimated peak exceeds this (default 12 GiB)",
    )
    p.add_argument("--cell-timeout", type=float, default=900.0, help="seconds before a cell is abandoned")
    p.add_argument("--no-plot", action="store_true")
    # Internal: one measurement in this process.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--small-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=(*IMPLS, "idle"), help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--against", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.heads is None:
        args.heads = 2 if args.quick else 4
    if args.min_time is None:
        args.min_time = 0.05 if args.quick else 2.0
    if args.sizes is None:
        args.sizes = [256, 512] if args.quick else [1024, 2048, 4096, 8192, 16384]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(paired_worker(args) if args.against else worker(args)))
        return 0
    if args.small_worker:
        print(json.dumps(small_worker(args)))
        return 0
    machine = machine_info()
    print(
        f"{machine['cpu']} ({machine['cpu_count']} cores, {machine['ram_gib']} GiB), torch {machine['torch']}, "
        f"{machine['date']}"
    )
    if args.small_calls:
        run_small_calls(args, machine)
        return 0
    if args.targets:
        run_targets(args, machine)
        return 0
    cells = [
        dict(impl=i, mode=m, batch=args.batch, heads=args.heads, seq_len=n, head_dim=args.head_dim)
        for n in args.sizes
        for m in args.modes
        for i in args.impls
    ]
    rows = measure(cells, args, machine)
    write_results(rows, machine, args.out, "cpu")
    write_summary(rows, machine, args.out / "summary.md")
    if not args.no_plot:
        title = (
            f"CPU attention, float32, B={args.batch} H={args.heads} D={args.head_dim}: {machine['cpu']}, "
            f"{machine['cpu_count']} cores, torch {machine['torch']}, {machine['date'][:10]}"
        )
        path = plot(rows, args.out, title)
        if path:
            print(f"wrote {path}")
    print(f"wrote {args.out / 'cpu.csv'}, {args.out / 'cpu.json'} and {args.out / 'summary.md'}")
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
