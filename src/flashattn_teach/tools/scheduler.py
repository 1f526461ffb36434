"""The GPU's block scheduler in plain Python: how a launch's programs fill the SMs' slots, and how many
programs an SM holds at once. Read by ``flashattn-teach kernels --schedule``
(:mod:`flashattn_teach.tools.kernels.waves`) and the replay page's GPU view
(:mod:`flashattn_teach.replay.gpu_schedule`).

The model. A chip has ``SMs * programs_per_sm`` slots. Programs start in program-id order, each on the slot
that frees up first, the lowest such slot on a tie (greedy list scheduling, the rule the hardware's block
scheduler follows), and run for their work (:mod:`.grid`). A program's wave is how many programs ran on its
slot before it. Reported: the makespan, the ideal ``total work / slots`` (no slot ever idle) and the idle
fraction ``1 - ideal / makespan``. Nothing of L2 or HBM contention is modelled.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

# registers, warps, blocks and shared memory per SM (CUDA C++ Programming Guide, compute capability 8.0, 9.0)
REGISTERS_PER_SM = 65536
REGISTER_UNIT = 256  # registers are allocated per warp, in units of this many
WARPS_PER_SM = 64
BLOCKS_PER_SM = 32
SMEM_PER_SM = {"sm90": 228 * 1024, "sm80": 164 * 1024}
SMEM_RESERVED = 1024  # per resident block, held by the system
H100_SMS = 132  # H100 SXM5


def programs_per_sm(arch: str, registers: int, smem_bytes: int, num_warps: int) -> int:
    """Programs of one kernel resident on an SM at once: the least of what registers, shared memory, warps
    and the block limit allow."""
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_registers = (REGISTERS_PER_SM // per_warp) // num_warps
    by_smem = SMEM_PER_SM[arch] // (smem_bytes + SMEM_RESERVED)
    return max(0, min(by_registers, by_smem, WARPS_PER_SM // num_warps, BLOCKS_PER_SM))


@dataclass(frozen=True)
class Run:
    """One program's place in the launch: its slot, when it starts and ends, and its wave on that slot."""

    slot: int
    start: float
    end: float
    wave: int  # 0: the first program on its slot


@dataclass(frozen=True)
class Schedule:
    """One launch on ``slots`` slots, times in the work's units (loop iterations, or tiles)."""

    makespan: float
    ideal: float  # total work / slots
    slots: int
    programs: int

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.ideal / self.makespan if self.makespan else 0.0

    @property
    def waves(self) -> float:
        return self.programs / self.slots


def place(work: Sequence[float], slots: int) -> list[Run]:
    """Greedy list scheduling: each program, in order, starts on the slot that frees first (the lowest slot
    of those free at once)."""
    if slots < 1:
        raise ValueError(f"slots must be at least 1, got {slots}")
    free = [(0.0, s) for s in range(slots)]  # (time the slot frees, slot)
    ran = [0] * slots  # programs placed on each slot so far
    runs = []
    for w in work:
        t, s = heapq.heappop(free)
        runs.append(Run(slot=s, start=t, end=t + w, wave=ran[s]))
        ran[s] += 1
        heapq.heappush(free, (t + w, s))
    return runs


def summarize(work: Sequence[float], runs: Sequence[Run], slots: int) -> Schedule:
    """The makespan and ideal of ``runs`` (from :func:`place`)."""
    return Schedule(
        makespan=max((r.end for r in runs), default=0.0), ideal=sum(work) / slots, slots=slots, programs=len(work)
    )


def simulate(work: Sequence[float], slots: int) -> Schedule:
    """The launch of programs with ``work``, in program-id order, on ``slots`` slots."""
    return summarize(work, place(work, slots), slots)
