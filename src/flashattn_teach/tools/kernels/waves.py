"""How a launch's programs fill the SMs: a simulation of the GPU's block scheduler, for each grid order of
:mod:`flashattn_teach.triton.kernels.grid`. No GPU needed; ``flashattn-teach kernels --schedule``. The
simulation, the grid orders and the work per program are plain Python below the kernel package
(:mod:`flashattn_teach.tools.scheduler`, :mod:`flashattn_teach.masks.grid`), which the replay page's GPU
view reads too; this module prices the shipped kernel configurations with them and prints the table.

The model. A chip has ``SMs * programs_per_sm`` slots (``programs_per_sm`` follows from a program's
registers, shared memory and warps: :func:`programs_per_sm`). Programs start in program-id order, each on
the slot that frees up first (the greedy rule the hardware's block scheduler follows), and a program's time
is its work:

    work = prologue + (unmasked tiles) + masked_weight * (masked tiles)        in loop iterations

counted from the tile geometry of :mod:`flashattn_teach.masks.causal` (a forward or dQ program visits the
key blocks its query block sees; a dK/dV program the query blocks that see its key block, for each of the
``GROUP`` query heads of its key head). The prologue and epilogue are priced as the iterations that move as
many bytes: a forward program reads ``Q_i`` and writes ``O_i`` (``2 BLOCK_M D``) where an iteration reads
``K_j, V_j`` (``2 BLOCK_N D``), so ``BLOCK_M / BLOCK_N``; dQ reads ``Q_i, dO_i`` and writes ``dQ_i``,
``1.5 BLOCK_M / BLOCK_N``; dK/dV reads ``K_j, V_j`` and writes ``dK_j, dV_j`` where an iteration reads
``Q_i, dO_i``, ``2 BLOCK_N / BLOCK_M``. ``masked_weight`` defaults to 1: the loop profile's masked and
unmasked stages have not been timed apart.

Reported per launch: the makespan, the ideal ``total work / slots`` (no slot ever idle), the idle fraction
``1 - total / (makespan * slots)`` and the waves ``programs / slots``. The model knows nothing of L2 or HBM
contention; the ``LONGEST`` order's head groups exist for L2, which it does not price.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..._optional import import_error, install_hint
from ...masks import grid
from ...masks.grid import ORDERS, LaunchShape
from ...triton.configs import KernelConfig, shipped_config
from ..scheduler import Schedule, programs_per_sm, simulate
from .loops import MODELS

__all__ = [
    "LaunchShape",
    "Schedule",
    "benchmark_shapes",
    "block_work",
    "launch_work",
    "print_schedule",
    "programs_per_sm",
    "simulate",
]

SCHEDULED_KERNELS = grid.KERNELS
# P without triton to compile the kernels: what triton 3.9 builds every shipped causal tile to, sm_90 and sm_80
# (docs/loop-profile.md's table); --programs-per-sm sets another
UNCOMPILED_PROGRAMS_PER_SM = 1
# the benchmark's grid (benchmarks/bench_attention.py): B * N = 16k tokens, H * D = 2048
_TOKENS, _HIDDEN = 16384, 2048


def block_work(kernel: str, shape: LaunchShape, c: KernelConfig, masked_weight: float = 1.0) -> list[float]:
    """Work of each program's block (index ``i`` for forward and dQ, ``j`` for dK/dV), in iterations."""
    return grid.block_work(kernel, shape, c.BLOCK_M, c.BLOCK_N, masked_weight)


def launch_work(
    kernel: str, shape: LaunchShape, c: KernelConfig, order: int, masked_weight: float = 1.0
) -> list[float]:
    """Each program's work in program-id order under ``order`` (the kernels take ``INDEX`` when not causal)."""
    return grid.launch_work(kernel, shape, c.BLOCK_M, c.BLOCK_N, order, masked_weight)


def benchmark_shapes(head_dims: Sequence[int], seq_lens: Sequence[int]) -> list[LaunchShape]:
    """The causal cells of benchmarks/bench_attention.py's grid."""
    return [
        LaunchShape(max(1, _TOKENS // n), max(1, _HIDDEN // d), n, n, d, causal=True)
        for d in head_dims
        for n in seq_lens
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flashattn-teach kernels --schedule``."""
    parser.add_argument(
        "--schedule",
        action="store_true",
        help="simulate the block scheduler for each grid order at the benchmark's causal shapes (docs/loop-profile.md)",
    )
    parser.add_argument(
        "--programs-per-sm",
        type=int,
        default=None,
        metavar="P",
        help="with --schedule: programs resident per SM (default: from each compiled kernel's resources, or 1 "
        "without triton)",
    )
    parser.add_argument(
        "--seq-len", nargs="+", type=int, default=None, help="with --schedule: sequence lengths (default: 2048 8192)"
    )


class Resources(Protocol):
    """What :func:`flashattn_teach.tools.kernels.report.compile_kernel` reports that occupancy needs."""

    @property
    def registers(self) -> int: ...
    @property
    def smem_bytes(self) -> int: ...


CompileFn = Callable[[str, str, torch.dtype, int, KernelConfig], Resources]


def print_schedule(args: argparse.Namespace, compile_kernel: CompileFn) -> int:
    """The ``--schedule`` table: per kernel and shape, each order's makespan against the ideal.

    ``compile_kernel(name, arch, dtype, head_dim, config)`` compiles a kernel for its registers and shared
    memory; it is not called when ``args.programs_per_sm`` is given."""
    dtype = torch.bfloat16
    problem = None
    if not args.schedule:
        problem = "--programs-per-sm and --seq-len go with --schedule"
    elif args.dtype and args.dtype != ["bfloat16"]:
        problem = "--schedule simulates bfloat16 only; drop --dtype"
    elif args.programs_per_sm is not None and args.programs_per_sm < 1:
        problem = "--programs-per-sm must be at least 1"
    elif any(n < 1 for n in args.seq_len or ()):
        problem = "--seq-len must be at least 1"
    else:
        others = [f"--{n}" for n in ("loops", "variants", "dropout", "varlen") if getattr(args, n, False)]
        others += [f"--{n}" for n in ("mask", "dump") if getattr(args, n, None) is not None]
        if others:
            problem = f"--schedule simulates the plain causal kernels; drop {' '.join(others)}"
    if problem is not None:
        print(f"flashattn-teach kernels: error: {problem}", file=sys.stderr)
        return 2
    sms = MODELS[args.arch].sms
    kernels = [k for k in (args.kernel or SCHEDULED_KERNELS) if k in SCHEDULED_KERNELS]
    print(
        f"# {args.arch}: {sms} SMs, greedy block scheduler; work in loop iterations (docs/loop-profile.md); "
        f"idle = 1 - ideal / makespan"
    )
    fixed_per_sm = args.programs_per_sm
    if fixed_per_sm is None and import_error("triton") is not None:  # a pure simulation: P is its one compiled input
        fixed_per_sm = UNCOMPILED_PROGRAMS_PER_SM
        print(
            f"# P/SM {fixed_per_sm} assumed (triton 3.9's builds of these tiles), triton is not installed; to compile "
            f"them: {install_hint('triton')}, or set --programs-per-sm P"
        )
    print(
        f"{'kernel':<14} {'D':>4} {'N':>6} {'B':>3} {'H':>3} {'tile':<16} {'P/SM':>4} {'waves':>6} {'ideal':>8}  "
        + "  ".join(f"{name + ' (idle)':>19}" for name in ORDERS)
    )
    for shape in benchmark_shapes(args.head_dim or (64, 128), args.seq_len or (2048, 8192)):
        config = shipped_config(shape.head_dim, dtype, args.arch)
        for name in kernels:
            c = config.kernel(name)
            if c is None:
                continue
            per_sm = fixed_per_sm
            if per_sm is None:
                os.environ.pop("TRITON_INTERPRET", None)  # compiling ahead of time needs it unset
                r = compile_kernel(name, args.arch, dtype, shape.head_dim, c)
                per_sm = programs_per_sm(args.arch, r.registers, r.smem_bytes, c.num_warps)
            runs = {o: simulate(launch_work(name, shape, c, v), sms * per_sm) for o, v in ORDERS.items()}
            first = next(iter(runs.values()))
            cells = "  ".join(f"{r.makespan:>10.0f} ({r.idle_fraction:>5.1%})" for r in runs.values())
            print(
                f"{name.removeprefix('backward_'):<14} {shape.head_dim:>4} {shape.seq_q:>6} {shape.batch:>3} "
                f"{shape.heads:>3} {c!s:<16} {per_sm:>4} {first.waves:>6.1f} {first.ideal:>8.0f}  {cells}",
                flush=True,
            )
    return 0
