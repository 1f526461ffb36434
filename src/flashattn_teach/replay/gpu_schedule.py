"""The GPU's view of a replay: the forward kernel's grid of programs (query blocks x heads) and when each
program runs on a GPU's SMs, in the kernels' index order and longest first (the replay page's "GPU
schedule" tab, ``page_gpu.js``).

One program of the forward kernel owns query block ``i`` of one head and visits the key blocks the replay
visits for it (FA2 Alg. 1's outer loop, one program per ``i``: ``T_r x H`` programs). Its work is the tiles it
computes, ``|cols_i|`` (:mod:`.schedule`; under a causal mask block ``i`` sees about ``i + 1`` key blocks).
The block scheduler (:mod:`flashattn_teach.tools.scheduler`) starts the programs in program-id order, each on
the SM slot that frees first; the kernels' grid orders (:mod:`flashattn_teach.masks.grid`, the mirror of
``triton/kernels/grid.py``) give the program ids:

    index     head 0's blocks 0 .. T_r - 1, then head 1's (the kernels' order without a mask)
    longest   all heads' last (longest) blocks first, then the next ones (the kernels' order under causal)

Started in index order, the longest programs come last and run alone in the tail; longest first, the short
ones fill the gaps (greedy list scheduling, LPT). Times are in tile-times (one tile's work); the page steps
through the times at which a program starts or ends.

The picture runs on a pretend GPU of ``gpu_sms`` SMs (default 2, one program each): the teaching grid, 3
query blocks x 4 heads, is one partial wave on an H100's 132 SMs, where every program starts at once and the
order cannot matter. The payload also holds the H100 figures at the replay's shape, causal and not, and at
the benchmark's causal shape (N = 4096, D = 64, B = 4, H = 32, 128 x 128 tiles, in loop iterations with the
prologue as ``flashattn-teach kernels --schedule`` prices them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..errors import AttentionValueError
from ..masks.grid import INDEX, LONGEST, LaunchShape, block_work, grid_order, launch_work
from ..tools.scheduler import H100_SMS, Run, Schedule, place, summarize
from .replay import Replay

ORDER_NAMES = {INDEX: "index", LONGEST: "longest"}
ORDER_TITLES = {
    INDEX: "index order: each head's blocks 0, 1, 2, ... (the kernels' order without a mask)",
    LONGEST: "longest first: every head's last block, then the next (the kernels' order under causal)",
}
MAX_HEADS, MAX_PER_SM = 16, 32
OPTIONS = ("gpu_heads", "gpu_sms", "gpu_programs_per_sm")  # the keyword arguments of render_html this view reads
# The benchmark's causal forward cell (benchmarks/bench_attention.py: B N = 16k tokens, H D = 2048).
BENCHMARK = LaunchShape(batch=4, heads=32, seq_q=4096, seq_k=4096, head_dim=64, causal=True)
BENCHMARK_TILE = (128, 128)


class FigureShape(Enum):
    """Whose shape a row of the H100 figures has."""

    REPLAY = "replay"  # the replay's grid, T_r x heads
    BENCHMARK = "benchmark"  # the benchmark's causal forward (BENCHMARK)


class ProgramState(Enum):
    """A program of the launch at one time."""

    WAITING = "waiting"  # not started: every slot busy, or its turn in program-id order not come
    RUNNING = "running"  # on a slot: start <= t < end
    DONE = "done"  # end <= t


@dataclass(frozen=True)
class GpuOptions:
    """The pretend GPU and grid of the picture: ``render_html(gpu_heads=, gpu_sms=, gpu_programs_per_sm=)``."""

    heads: int = 4
    sms: int = 2
    programs_per_sm: int = 1

    def __post_init__(self) -> None:
        for name, value, most in (
            ("gpu_heads", self.heads, MAX_HEADS),
            ("gpu_sms", self.sms, H100_SMS),
            ("gpu_programs_per_sm", self.programs_per_sm, MAX_PER_SM),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
                raise AttentionValueError(f"{name} must be an int from 1 to {most}, got {value!r}")

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> GpuOptions:
        """The options of :data:`OPTIONS` that ``options`` gives, the defaults for the others."""
        default = cls()
        return cls(
            heads=options.get("gpu_heads", default.heads),
            sms=options.get("gpu_sms", default.sms),
            programs_per_sm=options.get("gpu_programs_per_sm", default.programs_per_sm),
        )

    @property
    def slots(self) -> int:
        return self.sms * self.programs_per_sm


@dataclass(frozen=True)
class Program:
    """Program ``pid``: query block ``i`` of head ``head``, ``work`` tiles, and where and when it ran."""

    pid: int
    i: int
    head: int
    work: float
    run: Run

    def state(self, t: float) -> ProgramState:
        if self.run.end <= t:
            return ProgramState.DONE
        return ProgramState.RUNNING if self.run.start <= t else ProgramState.WAITING


@dataclass(frozen=True)
class Launch:
    """One launch of the grid in one order: its programs in program-id order and its schedule."""

    order: int  # masks.grid.INDEX or LONGEST
    programs: tuple[Program, ...]
    schedule: Schedule


def launch(work: Sequence[float], heads: int, order: int, slots: int, n_rows: int, row_bytes: int) -> Launch:
    """The ``len(work) x heads`` grid (``work[i]``: query block ``i``'s) launched in ``order`` on ``slots``."""
    ids = grid_order(len(work), heads, n_rows, order, longest_last=True, row_bytes=row_bytes)
    costs = [work[i] for i, _ in ids]
    runs = place(costs, slots)
    programs = tuple(Program(pid, i, h, work[i], run) for pid, ((i, h), run) in enumerate(zip(ids, runs, strict=True)))
    return Launch(order, programs, summarize(costs, runs, slots))


def query_block_work(replay: Replay) -> list[float]:
    """``|cols_i|`` for every query block: the tiles its program computes (the replay's mask contract)."""
    return [float(len(replay.schedule.key_blocks(i))) for i in range(replay.T_r)]


def _row_bytes(replay: Replay) -> int:
    """The forward kernel's ROW_BYTES: a row of K and V, 16-bit (``2 (D + D_v)``)."""
    return 2 * (replay.steps.k.shape[-1] + replay.steps.v.shape[-1])


def gpu_launches(replay: Replay, options: GpuOptions = GpuOptions()) -> tuple[Launch, Launch]:
    """The replay's grid (``T_r x options.heads``) in index order and longest first, on the pretend GPU."""
    work = query_block_work(replay)
    return tuple(  # type: ignore[return-value]
        launch(work, options.heads, order, options.slots, replay.N_k, _row_bytes(replay)) for order in ORDER_NAMES
    )


def event_times(launches: Sequence[Launch]) -> list[float]:
    """Every time a program of any launch starts or ends, increasing: the page's steps."""
    return sorted({t for la in launches for p in la.programs for t in (p.run.start, p.run.end)} | {0.0})


def _figures(schedule: Schedule) -> dict[str, Any]:
    return {
        "programs": schedule.programs,
        "waves": schedule.waves,
        "makespan": schedule.makespan,
        "ideal": schedule.ideal,
        "idle": schedule.idle_fraction,
    }


def h100_figures(replay: Replay, options: GpuOptions = GpuOptions()) -> list[dict[str, Any]]:
    """Each order's makespan on an H100's ``132 x programs_per_sm`` slots: the replay's grid causal and not
    (work from the tile geometry of :mod:`flashattn_teach.masks.causal`), then the benchmark's causal forward."""
    slots = H100_SMS * options.programs_per_sm
    D = replay.steps.k.shape[-1]
    rows = []
    for causal in (True, False):
        shape = LaunchShape(1, options.heads, replay.N_q, replay.N_k, D, causal, offset=replay.diagonal_offset)
        work = block_work("forward", shape, replay.block_m, replay.block_n, with_prologue=False)
        for order, name in ORDER_NAMES.items():
            la = launch(work, options.heads, order, slots, replay.N_k, _row_bytes(replay))
            rows.append({"shape": FigureShape.REPLAY.value, "causal": causal, "order": name, **_figures(la.schedule)})
    bm, bn = BENCHMARK_TILE
    for order, name in ORDER_NAMES.items():
        schedule = summarize(w := launch_work("forward", BENCHMARK, bm, bn, order), place(w, slots), slots)
        rows.append({"shape": FigureShape.BENCHMARK.value, "causal": True, "order": name, **_figures(schedule)})
    return rows


def build(replay: Replay, options: Mapping[str, Any]) -> dict[str, Any]:
    """The "gpu" view's payload: the grid, both launches on the pretend GPU, the page's times, H100 figures."""
    opts = GpuOptions.of(options)
    launches = gpu_launches(replay, opts)
    return {
        "states": {s.name: s.value for s in ProgramState},
        "shapes": {s.name: s.value for s in FigureShape},
        "shape": {
            "N_q": replay.N_q,
            "N_k": replay.N_k,
            "blockM": replay.block_m,
            "blockN": replay.block_n,
            "T_r": replay.T_r,
            "heads": opts.heads,
            "masks": replay.labels(),
        },
        "gpu": {"sms": opts.sms, "programsPerSm": opts.programs_per_sm, "slots": opts.slots},
        "work": query_block_work(replay),
        "times": event_times(launches),
        "launches": [
            {
                "order": ORDER_NAMES[la.order],
                "title": ORDER_TITLES[la.order],
                **_figures(la.schedule),
                "programs": [
                    {
                        "pid": p.pid,
                        "i": p.i,
                        "head": p.head,
                        "work": p.work,
                        "slot": p.run.slot,
                        "start": p.run.start,
                        "end": p.run.end,
                        "wave": p.run.wave,
                    }
                    for p in la.programs
                ],
            }
            for la in launches
        ],
        "h100": {"sms": H100_SMS, "benchmark": _benchmark_label(), "rows": h100_figures(replay, opts)},
    }


def _benchmark_label() -> str:
    s, (bm, bn) = BENCHMARK, BENCHMARK_TILE
    return f"B={s.batch}, H={s.heads}, N={s.seq_q}, D={s.head_dim}, causal, {bm}x{bn} tiles"
