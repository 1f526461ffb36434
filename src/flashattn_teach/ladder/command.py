"""``flashattn-teach ladder``: climb the rungs of :mod:`.rungs` on one set of inputs, check each, print the
table of what each costs and saves."""

from __future__ import annotations

import argparse
import os
import statistics
import textwrap
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from .._cli_types import positive_int, seed
from ..core import dense
from ..tools.iomodel import standard_forward_io
from .rungs import DTYPES, RUNGS, Forward, Inputs, kernel_device

WIDTH = 80
NOT_TIMED = "interpreter: not timed; timed by benchmarks/run_gpu_suite.sh on a GPU"


@dataclass(frozen=True)
class Step:
    """One row of the table. ``why_not``: why the rung did not run, one line that names what to install
    (then nothing else is set); ``seconds`` is None for a kernel in the interpreter."""

    number: int
    name: str
    why_not: str | None = None
    tile: tuple[int, int] | None = None
    hbm_bytes: int = 0
    tolerance: float = 0.0
    seconds: float | None = None
    vs_previous: float | None = None  # max |O - O of the last rung that ran and passed|
    previous_tolerance: float = 0.0
    vs_oracle: float = 0.0  # max |O - O_float64|
    lse_vs_oracle: float = 0.0


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
    previous: tuple[Tensor, float] | None = None  # O of the last rung that passed, and its tolerance
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
        step = Step(
            number,
            name,
            tile=rung.tile,
            hbm_bytes=rung.hbm_bytes,
            tolerance=rung.tolerance,
            seconds=seconds,
            vs_previous=None if previous is None else _max_diff(O, previous[0]),
            previous_tolerance=0.0 if previous is None else previous[1],
            vs_oracle=_max_diff(O, O64),
            lse_vs_oracle=_max_diff(lse, lse64),
        )
        steps.append(step)
        if step.vs_oracle <= step.tolerance:
            previous = (O, step.tolerance)
    return steps


def failures(steps: list[Step]) -> list[str]:
    """A line for each rung beyond its tolerance against the oracle, or beyond the sum of its and the
    previous rung's against that rung."""
    found = []
    for s in steps:
        if s.why_not is not None:
            continue
        checks = [
            ("|O - float64 dense|", s.vs_oracle, s.tolerance),
            ("|lse - float64 dense|", s.lse_vs_oracle, s.tolerance),
        ]
        if s.vs_previous is not None:
            checks.append(("|O - previous rung|", s.vs_previous, s.tolerance + s.previous_tolerance))
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


def tile_size(text: str) -> int:
    """A tile side every tiled rung takes: a power of two >= 16, ``tl.dot``'s smallest."""
    value = positive_int(text)
    if value < 16 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two >= 16 (tl.dot's smallest tile), got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=positive_int, default=113, help="sequence length N (default 113, awkward)")
    parser.add_argument("--d", type=positive_int, default=64, help="head dimension D (default 64)")
    parser.add_argument("--batch", type=positive_int, default=1, help="batch size B (default 1)")
    parser.add_argument("--heads", type=positive_int, default=2, help="heads H (default 2)")
    parser.add_argument("--causal", action="store_true", help="causal attention (top-left diagonal)")
    tile = "of the loops and the tutorial kernel: a power of two >= 16 (default 32)"
    parser.add_argument("--block-m", type=tile_size, default=32, help=f"BLOCK_M {tile}")
    parser.add_argument("--block-n", type=tile_size, default=32, help=f"BLOCK_N {tile}")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype (default float32)")
    parser.add_argument("--seed", type=seed, default=0, help="torch.manual_seed for the inputs (default 0)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per rung (default 3)")


def interpret_without_cuda() -> str:
    """Set ``TRITON_INTERPRET=1`` when there is no CUDA device, and say where the kernels run. Called before
    triton is imported: the variable must be in the environment before a ``@triton.jit`` kernel is defined."""
    from ..triton.devices import interpreting

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
    where = interpret_without_cuda()
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
    if kernel_device().type == "cuda":
        _say(f"time: median of {args.repeats} runs; CPU rungs on the CPU, kernels on the GPU (CUDA events)")
    else:
        _say(f"time: median of {args.repeats} runs on the CPU; *{NOT_TIMED}")
    bad = failures(steps)
    for line in bad:
        _say(line)
    if bad:
        print("check: FAILED, a rung disagrees beyond its tolerance (above)")
        return 1
    ran = [s for s in steps if s.why_not is None]
    tol = x.tolerance()
    looser = "".join(f"; rung {s.number} {s.tolerance:.0e} (TF32)" for s in ran if s.tolerance != tol)
    _say(f"check: ok, {len(ran)} of {len(steps)} rungs within {tol:.0e} of float64 dense{looser}")
    return 0
