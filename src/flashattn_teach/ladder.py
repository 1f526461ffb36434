"""``flashattn-teach ladder``: from dense attention to the production kernel, one rung at a time.

Every rung computes the same ``O`` and ``lse`` from the same inputs, each a step nearer the GPU:

    1  dense              core/dense.py: S = Q K^T, P = softmax(S), O = P V; holds every score
    2  query-major loop   core/loops.py (FA2 Alg. 1): query blocks outside; one BLOCK_M x BLOCK_N tile of S
                          at a time, folded in by the online softmax
    3  key-major loop     core/loops.py (FA1 Alg. 1): key blocks outside; O_i, l_i, m_i go back to HBM
                          after every key block
    4  tutorial kernel    core/kernel.py: rung 2 as one Triton program per query block
    5  production kernel  flashattn_teach.triton: rung 4 with every variant, the shipped tiles, TMA

Each rung is checked against the one before it and against the float64 dense oracle (rung 1's function in
float64). Beside each one stands what it costs and saves: the scores it holds at once per (batch, head),
the HBM bytes the IO model (:mod:`flashattn_teach.iomodel`) counts for its schedule, and its time where the
machine can tell: the CPU rungs on the CPU, the kernels with CUDA events on a GPU. Without CUDA the kernels
run in Triton's interpreter (``TRITON_INTERPRET=1``, which this command sets), for correctness only.
llm.c's ``dev/cuda`` ladder checks each kernel against a CPU reference the same way.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ._cli_types import positive_int, seed
from .core import dense, loops
from .iomodel import Problem, key_major_forward_io, query_major_forward_io, standard_forward_io

WIDTH = 80
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
# max |O - float64 dense| and |lse - float64 dense| a rung may show; two rungs may differ by twice this
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}
TRITON_EXTRA = "pip install 'flashattn-teach[triton]'"
NOT_TIMED = "interpreter: not timed; timed by benchmarks/run_gpu_suite.sh on a GPU"

Forward = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]  # (q, k, v) -> (O, lse)


@dataclass(frozen=True)
class Inputs:
    """The one problem every rung solves: ``q, k, v (B, H, N, D)`` on the CPU."""

    q: Tensor
    k: Tensor
    v: Tensor
    causal: bool
    block_m: int  # the CPU loops' tile
    block_n: int

    def problem(self) -> Problem:
        B, H, N, D = self.q.shape
        return Problem(B, H, N, D, elem_bytes=self.q.element_size(), causal=self.causal)


@dataclass(frozen=True)
class Rung:
    """A rung ready to run: its forward, its tile (None: it holds every score) and its schedule's bytes."""

    forward: Forward
    tile: tuple[int, int] | None
    hbm_bytes: int
    device: torch.device  # where its inputs live: the CPU, or CUDA for a kernel on a GPU
    triton: bool = False  # a Triton kernel: on the CPU, in the interpreter (not timed)


@dataclass(frozen=True)
class Step:
    """One row of the table. ``why_not``: why the rung did not run, one line that names what to install
    (then nothing else is set); ``seconds`` is None for a kernel in the interpreter."""

    number: int
    name: str
    why_not: str | None = None
    tile: tuple[int, int] | None = None
    hbm_bytes: int = 0
    seconds: float | None = None
    vs_previous: float | None = None  # max |O - O of the last rung that ran|
    vs_oracle: float = 0.0  # max |O - O_float64|
    lse_vs_oracle: float = 0.0


# ----------------------------------------------------------------------------------------------- the rungs


def _dense(x: Inputs) -> Rung:
    def forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return dense.dense_attention(q, k, v, causal=x.causal)

    return Rung(forward, None, standard_forward_io(x.problem()).total_bytes, torch.device("cpu"))


def _query_major(x: Inputs) -> Rung:
    def forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return loops.query_major_attention(q, k, v, causal=x.causal, block_m=x.block_m, block_n=x.block_n)

    io = query_major_forward_io(x.problem(), x.block_m, x.block_n)
    return Rung(forward, (x.block_m, x.block_n), io.total_bytes, torch.device("cpu"))


def _key_major(x: Inputs) -> Rung:
    def forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return loops.key_major_attention(q, k, v, causal=x.causal, block_m=x.block_m, block_n=x.block_n)

    io = key_major_forward_io(x.problem(), x.block_m, x.block_n)
    return Rung(forward, (x.block_m, x.block_n), io.total_bytes, torch.device("cpu"))


def kernel_device() -> torch.device:
    """CUDA when there is a GPU and Triton is not interpreting; else the CPU, in the interpreter."""
    from .triton.devices import interpreting

    return torch.device("cuda" if torch.cuda.is_available() and not interpreting() else "cpu")


def triton_missing() -> str | None:
    """Why triton cannot be imported, as the rest of a one-line ``rung n name: ...`` that names the extra
    to install; or None."""
    try:
        import triton  # noqa: F401  (only whether it imports)
    except ImportError as e:
        if importlib.util.find_spec("triton") is None:
            return f"needs triton: {TRITON_EXTRA}"
        return f"not run: triton does not import ({e})"
    return None


def _kernel_reason(x: Inputs, device: torch.device) -> str | None:
    """Why the Triton kernels cannot run these inputs on ``device`` (the library's one answer), or None."""
    from .triton import unsupported_reason

    missing = triton_missing()
    if missing is not None:
        return missing
    q, k, v = (t.to(device) for t in (x.q, x.k, x.v))
    reason = unsupported_reason(q, k, v, causal=x.causal)
    return None if reason is None else f"not run: {reason}"


def _tutorial(x: Inputs) -> Rung | str:
    device = kernel_device()
    reason = _kernel_reason(x, device)
    if reason is not None:
        return reason
    from .core import kernel

    def forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return kernel.triton_forward(q, k, v, causal=x.causal)

    tile = (kernel.BLOCK_M, kernel.BLOCK_N)
    return Rung(forward, tile, query_major_forward_io(x.problem(), *tile).total_bytes, device, triton=True)


def production_tile(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)`` of the forward the library launches for plain ``(B, H, N, D)`` inputs: the
    shipped configuration (the test configuration in the interpreter) as ``triton.launch.forward`` narrows it
    (warp-specialised, else by TMA or by pointers)."""
    from ._validate.inputs import validate_inputs
    from .triton.configs import lane_groups
    from .triton.launch import default_config
    from .triton.tma import forward_tile, launch_tile
    from .triton.variants import PLAIN

    s = validate_inputs(q, k, v)
    tile, ws = forward_tile(default_config(q, s).forward, q, k, v, PLAIN)
    if not ws:
        _, split_lanes = lane_groups(s.D)
        tile = tile.by_pointers() if split_lanes else launch_tile(tile, k, v, varlen=False)[0]
    return tile.BLOCK_M, tile.BLOCK_N


def _production(x: Inputs) -> Rung | str:
    device = kernel_device()
    reason = _kernel_reason(x, device)
    if reason is not None:
        return reason
    from .triton import triton_attention

    def forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        O, lse = triton_attention(q, k, v, causal=x.causal, return_lse=True)
        return O, lse

    tile = production_tile(*(t.to(device) for t in (x.q, x.k, x.v)))
    return Rung(forward, tile, query_major_forward_io(x.problem(), *tile).total_bytes, device, triton=True)


# name -> how to build it; a builder returns the rung, or why it cannot run (one line)
RUNGS: dict[str, Callable[[Inputs], Rung | str]] = {
    "dense": _dense,
    "query-major loop": _query_major,
    "key-major loop": _key_major,
    "tutorial kernel": _tutorial,
    "production kernel": _production,
}


# ----------------------------------------------------------------------------------------------- the climb


def median_seconds(forward: Forward, q: Tensor, k: Tensor, v: Tensor, repeats: int) -> float:
    """The median of ``repeats`` timed calls: wall clock on the CPU, CUDA events on a GPU."""
    times = []
    for _ in range(repeats):
        if q.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            forward(q, k, v)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
        else:
            t0 = time.perf_counter()
            forward(q, k, v)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _max_diff(a: Tensor, b: Tensor) -> float:
    return (a.cpu().double() - b.cpu().double()).abs().max().item()


def climb(x: Inputs, repeats: int = 3) -> list[Step]:
    """Run the rungs of :data:`RUNGS` in order on ``x``: each is checked against the float64 dense oracle
    and against the last rung before it that ran and passed that check (so one broken rung is named once),
    and timed (``repeats`` calls after the checked one) where the device allows."""
    O64, lse64 = dense.dense_attention(x.q.double(), x.k.double(), x.v.double(), causal=x.causal)
    steps: list[Step] = []
    previous: Tensor | None = None
    for number, (name, build) in enumerate(RUNGS.items(), start=1):
        rung = build(x)
        if isinstance(rung, str):
            steps.append(Step(number, name, why_not=rung))
            continue
        q, k, v = (t.to(rung.device) for t in (x.q, x.k, x.v))
        with torch.no_grad():
            O, lse = rung.forward(q, k, v)
            interpreted = rung.triton and rung.device.type == "cpu"
            seconds = None if interpreted else median_seconds(rung.forward, q, k, v, repeats)
        steps.append(
            Step(
                number,
                name,
                tile=rung.tile,
                hbm_bytes=rung.hbm_bytes,
                seconds=seconds,
                vs_previous=None if previous is None else _max_diff(O, previous),
                vs_oracle=_max_diff(O, O64),
                lse_vs_oracle=_max_diff(lse, lse64),
            )
        )
        if _max_diff(O, O64) <= TOLERANCE[x.q.dtype]:
            previous = O
    return steps


def failures(steps: list[Step], dtype: torch.dtype) -> list[str]:
    """A line for each rung beyond :data:`TOLERANCE`: against the oracle, or twice it against the rung before."""
    tol = TOLERANCE[dtype]
    found = []
    for s in steps:
        if s.why_not is not None:
            continue
        checks = [("|O - float64 dense|", s.vs_oracle, tol), ("|lse - float64 dense|", s.lse_vs_oracle, tol)]
        if s.vs_previous is not None:
            checks.append(("|O - previous rung|", s.vs_previous, 2 * tol))
        found += [
            f"rung {s.number} {s.name}: max {what} = {value:.1e}, beyond {limit:.0e}"
            for what, value, limit in checks
            if not value <= limit  # NaN fails too
        ]
    return found


# ----------------------------------------------------------------------------------------------- the table


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _seconds(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-6:.3g} us"


ROW = "{:<19} {:>13} {:>16} {:>8} {:>8} {:>8}"


def table(steps: list[Step], x: Inputs) -> str:
    """The rungs as an 80-column table: scores held at once per (batch, head), HBM bytes of the schedule
    (and their share of dense's), time, and the two checks."""
    N_q, N_k = x.q.shape[-2], x.k.shape[-2]
    dense_bytes = standard_forward_io(x.problem()).total_bytes
    lines = [ROW.format("rung", "scores held", "HBM bytes", "time", "|O-prev|", "|O-f64|")]
    for s in steps:
        label = f"{s.number} {s.name}"
        if s.why_not is not None:
            lines.append(ROW.format(label, "-", "-", "not run", "-", "-"))
            continue
        bm, bn = s.tile if s.tile is not None else (N_q, N_k)
        lines.append(
            ROW.format(
                label,
                f"{bm}x{bn}={bm * bn}",
                f"{_bytes(s.hbm_bytes)} {s.hbm_bytes / dense_bytes:.2f}x",
                "interp.*" if s.seconds is None else _seconds(s.seconds),
                "-" if s.vs_previous is None else f"{s.vs_previous:.1e}",
                f"{s.vs_oracle:.1e}",
            )
        )
    return "\n".join(line.rstrip() for line in lines)


# ----------------------------------------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=positive_int, default=113, help="sequence length N (default 113, awkward)")
    parser.add_argument("--d", type=positive_int, default=64, help="head dimension D (default 64)")
    parser.add_argument("--batch", type=positive_int, default=1, help="batch size B (default 1)")
    parser.add_argument("--heads", type=positive_int, default=2, help="heads H (default 2)")
    parser.add_argument("--causal", action="store_true", help="causal attention (top-left diagonal)")
    parser.add_argument("--block-m", type=positive_int, default=32, help="BLOCK_M of the CPU loops (default 32)")
    parser.add_argument("--block-n", type=positive_int, default=32, help="BLOCK_N of the CPU loops (default 32)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype (default float32)")
    parser.add_argument("--seed", type=seed, default=0, help="torch.manual_seed for the inputs (default 0)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per rung (default 3)")


def interpreter_note() -> str:
    """Where the kernels run, set up before triton is first imported: without CUDA, ``TRITON_INTERPRET=1``
    (which must be in the environment before a ``@triton.jit`` kernel is defined)."""
    from .triton.devices import interpreting

    if torch.cuda.is_available() and not interpreting():
        return f"kernels: on {torch.cuda.get_device_name()}, timed with CUDA events"
    if interpreting():
        return "kernels: in Triton's interpreter on the CPU (TRITON_INTERPRET=1)"
    os.environ["TRITON_INTERPRET"] = "1"
    return "kernels: in Triton's interpreter (no CUDA device: TRITON_INTERPRET=1 set here)"


def make_inputs(args: argparse.Namespace) -> Inputs:
    """``q, k, v (B, H, N, D)``: ``torch.manual_seed(seed)``, three float64 ``randn`` calls in the order q, k,
    v, each rounded to the dtype (so the float64 oracle sees exactly the rungs' inputs)."""
    torch.manual_seed(args.seed)
    shape = (args.batch, args.heads, args.n, args.d)
    q, k, v = (torch.randn(shape, dtype=torch.float64).to(DTYPES[args.dtype]) for _ in range(3))
    return Inputs(q, k, v, causal=args.causal, block_m=args.block_m, block_n=args.block_n)


def _say(text: str) -> None:
    print(textwrap.fill(text, WIDTH, subsequent_indent="  "))


def run(args: argparse.Namespace) -> int:
    where = interpreter_note()
    x = make_inputs(args)
    B, H, N, D = x.q.shape
    mask = "causal" if x.causal else "not causal"
    print(f"ladder: q, k, v (B={B}, H={H}, N={N}, D={D}) {args.dtype}, seed {args.seed}, {mask}")
    _say(where)
    steps = climb(x, repeats=args.repeats)
    for s in steps:
        if s.why_not is not None:
            _say(f"rung {s.number} {s.name}: {s.why_not}")
    print()
    print(table(steps, x))
    print()
    _say("scores held: at once per (batch, head): dense all N_q x N_k, the others one BLOCK_M x BLOCK_N tile")
    _say("HBM bytes: the IO model's count for the rung's schedule (flashattn-teach iomodel); 0.9x: of dense's")
    timed = "CUDA events on the GPU for the kernels" if kernel_device().type == "cuda" else NOT_TIMED
    _say(f"time: median of {args.repeats} runs; CPU rungs on the CPU; *{timed}")
    bad = failures(steps, x.q.dtype)
    for line in bad:
        _say(line)
    ran = sum(s.why_not is None for s in steps)
    tol = TOLERANCE[x.q.dtype]
    if bad:
        print(f"check: FAILED ({len({line.split(':')[0] for line in bad})} rung(s) beyond tolerance)")
        return 1
    print(f"check: ok, {ran} of {len(steps)} rungs within {tol:.0e} of float64 dense ({args.dtype})")
    return 0
