"""The backward's trace build, host side (issue 39): the trace buffer's layout, what the build traces, its records.

:func:`flashattn_teach.triton.launch.backward` with ``trace=BackwardTrace.allocate(...)`` launches the dK/dV and
dQ kernels with ``TRACE=True`` (:mod:`.kernels.trace_backward` writes the records) and the buffer in
``row_stats.trace``; the program of head ``(b, h)`` writes each step's state, float32, in the kernel's units:

    dkdv()       (T_c, T_r, BLOCK_N, W)   key rows of [P_ij^T | dP_ij^T | dS_ij^T | dK_j | dV_j] per (j, i)
    partials()   (T_c, T_r, BLOCK_M, BLOCK_D + 1)   the one-kernel backward's scale dS_ij K_j and its order
    dq()         (T_r, T_c, BLOCK_M, W')  query rows of [P_ij | dP_ij | dS_ij | dS_ij K_j | dQ_i] per (i, j)

NaN where no program wrote (a tile the kernel skips, or the pass that did not run). The build traces the path
through pointers (no TMA, no warp specialisation: :meth:`BackwardTrace.check_tile` takes the tile that launches),
plain and causal attention, one lane group, no grouped-query heads, an unsplit dK/dV program;
:meth:`BackwardTrace.check_call` refuses the rest by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .._validate.inputs import AttentionShapes
from ..errors import AttentionValueError
from .configs import KernelConfig
from .lanes import block_d, lane_groups
from .variants import KernelVariants

__all__ = ["HEADER", "BackwardTrace", "check_trace", "check_trace_tile"]

HEADER = 8  # kernels.trace_backward.HEADER: [b, h, counter, T_r, T_c, starts of the three regions]
MAX_ELEMENTS = 1 << 24  # the header's offsets are float32, exact below 2^24


@dataclass(frozen=True)
class BackwardTrace:
    """A trace buffer (``buffer``, flat float32) and the sizes that lay it out: the grid ``T_r x T_c`` of
    ``block_m x block_n`` tiles, the padded head dims ``BLOCK_D, BLOCK_DV``."""

    buffer: Tensor
    T_r: int
    T_c: int
    block_m: int
    block_n: int
    BLOCK_D: int
    BLOCK_DV: int

    @staticmethod
    def allocate(
        s: AttentionShapes, block_m: int, block_n: int, *, b: int = 0, h: int = 0, device: torch.device | str = "cpu"
    ) -> BackwardTrace:
        """A NaN-filled buffer for the backward of ``s`` at tiles ``block_m x block_n``, tracing head ``(b, h)``."""
        T_r, T_c = math.ceil(s.N_q / block_m), math.ceil(s.N_k / block_n)
        shape = BackwardTrace(torch.empty(0), T_r, T_c, block_m, block_n, block_d(s.D), block_d(s.D_v))
        starts = shape._starts()
        if starts[-1] > MAX_ELEMENTS:
            raise AttentionValueError(
                f"trace: the backward of N_q={s.N_q}, N_k={s.N_k} at tiles {block_m} x {block_n} needs {starts[-1]} "
                f"trace entries, more than {MAX_ELEMENTS} (its offsets are float32): trace a shorter sequence"
            )
        buffer = torch.full((starts[-1],), math.nan, dtype=torch.float32, device=device)
        buffer[:HEADER] = torch.tensor([b, h, 0, T_r, T_c, *starts[:3]], dtype=torch.float32)
        return BackwardTrace(buffer, T_r, T_c, block_m, block_n, shape.BLOCK_D, shape.BLOCK_DV)

    @property
    def widths(self) -> tuple[int, int, int]:
        """The records' row widths: dK/dV, dQ partial (with its order), dQ."""
        BM, BN, BD = self.block_m, self.block_n, self.BLOCK_D
        return 3 * BM + BD + self.BLOCK_DV, BD + 1, 3 * BN + 2 * BD

    def _starts(self) -> tuple[int, int, int, int]:
        """Where the dK/dV records, the dQ partials and the dQ records start, and the buffer's end."""
        W_kv, W_part, W_q = self.widths
        tiles = self.T_r * self.T_c
        kv = HEADER
        part = kv + tiles * self.block_n * W_kv
        dq = part + tiles * self.block_m * W_part
        return kv, part, dq, dq + tiles * self.block_m * W_q

    def _region(self, n: int, shape: tuple[int, ...]) -> Tensor:
        starts = self._starts()
        return self.buffer[starts[n] : starts[n + 1]].view(shape)

    def dkdv(self) -> Tensor:
        """``(T_c, T_r, BLOCK_N, W)``: the dK/dV program's records."""
        return self._region(0, (self.T_c, self.T_r, self.block_n, self.widths[0]))

    def partials(self) -> Tensor:
        """``(T_c, T_r, BLOCK_M, BLOCK_D + 1)``: the one-kernel backward's dQ partials, each row ending in its order."""
        return self._region(1, (self.T_c, self.T_r, self.block_m, self.widths[1]))

    def dq(self) -> Tensor:
        """``(T_r, T_c, BLOCK_M, W')``: the dQ program's records."""
        return self._region(2, (self.T_r, self.T_c, self.block_m, self.widths[2]))

    def check_call(self, s: AttentionShapes, variants: KernelVariants, B: int) -> None:
        """A named error for a call the trace build does not trace, or one this buffer was not laid out for."""
        b, h = (int(x) for x in self.buffer[:2].tolist())
        refused = {
            "a mask variant, dropout, packed sequences or FlexAttention's functions": variants.used,
            f"grouped-query attention (H_q={s.H_q}, H_kv={s.H_kv})": s.group != 1,
            f"a head dim of two lane groups (D={s.D})": lane_groups(s.D)[1] > 0,
        }
        for what, asked in refused.items():
            if asked:
                raise AttentionValueError(
                    f"trace: the backward's trace build traces plain and causal attention of one lane group and "
                    f"no grouped heads, not {what}: leave it out or trace=None"
                )
        grid = (math.ceil(s.N_q / self.block_m), math.ceil(s.N_k / self.block_n), block_d(s.D), block_d(s.D_v))
        mine = (self.T_r, self.T_c, self.BLOCK_D, self.BLOCK_DV)
        if grid != mine or not (0 <= b < B and 0 <= h < s.H_q):
            raise AttentionValueError(
                f"trace: a buffer for (T_r, T_c, BLOCK_D, BLOCK_DV) = {mine} "
                f"and head (b, h) = ({b}, {h}), this call has {grid}, B={B}, H_q={s.H_q}: "
                "BackwardTrace.allocate it for this call"
            )

    def check_tile(self, kernel: str, c: KernelConfig) -> None:
        """A named error where kernel ``kernel``'s launched tile is not the buffer's, or is split."""
        if (c.BLOCK_M, c.BLOCK_N) != (self.block_m, self.block_n) or c.split:
            raise AttentionValueError(
                f"trace: {kernel} launches {c.BLOCK_M} x {c.BLOCK_N}{' split' if c.split else ''}, the buffer is laid "
                f"out for {self.block_m} x {self.block_n} unsplit: pass a config whose backward tiles are the buffer's "
                "(AttentionConfig.uniform(block_m, block_n))"
            )


def check_trace(trace: BackwardTrace | None, s: AttentionShapes, variants: KernelVariants, B: int) -> None:
    """:meth:`BackwardTrace.check_call` of a launch that traces; nothing without a ``trace``."""
    if trace is not None:
        trace.check_call(s, variants, B)


def check_trace_tile(trace: BackwardTrace | None, kernel: str, c: KernelConfig) -> None:
    """:meth:`BackwardTrace.check_tile` of a launch that traces; nothing without a ``trace``."""
    if trace is not None:
        trace.check_tile(kernel, c)
