"""The backward kernels' own numbers: the production dK/dV and dQ kernels' trace read into the backward replay's steps
(``replay_backward(..., source="triton")``).

:func:`run_backward_trace` runs :func:`flashattn_teach.triton.launch.backward` on one head with a trace buffer
(:mod:`flashattn_teach.triton.trace_backward`): the kernels' trace build writes each step's state, and
:class:`KernelBackwardTrace` reads record ``(i, j)`` back in the reference's units and names, so a dK/dV step carries
``step.kernel`` = ``P_ij, dP_ij, dS_ij, dV_j, dK_j`` and a dQ step ``P_ij, dP_ij, dS_ij, dQ_i`` beside
``step.terms`` (``step.kernel_diff``). The kernel's units differ from the reference's by a known factor, taken
out here: the one-kernel backward's ``dS`` comes scaled (divided by ``scale`` here), the two-kernel backward's
``dK_j`` and ``dQ_i`` unscaled (multiplied by it).

The one-kernel backward (the default, ``deterministic=False``) has no dQ program: its dK/dV program adds each
step's ``scale dS_ij K_j`` into dQ by atomic adds. A dQ step's ``P, dP, dS`` are then the dK/dV program's record of
the same tile, and its ``dQ_i`` is what dQ's rows held just after that partial arrived: the partials of query block
``i`` summed in float32 in the order the trace's counter saw them reach dQ (:meth:`KernelBackwardTrace.order`). In
the interpreter the programs run one after another, so they arrive in increasing ``j``, the reference's order; on
a GPU any order, and ``dQ_i`` after a step then holds the partials that came before it. ``deterministic=True``
runs the two-kernel backward, whose dQ program walks ``j`` in increasing order and writes ``dQ_i`` once.

On a CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set here before the kernels are first
imported), on a GPU compiled. The kernels tile in powers of two >= 16 (``tl.dot``'s minimum): the replay is made at
the replay's tiles rounded up to those (:func:`kernel_blocks`).
"""

from __future__ import annotations

import functools
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .._validate.inputs import AttentionShapes
from ..errors import AttentionValueError
from ..triton.configs import AttentionConfig, fused_backward
from ..triton.lanes import block_d, lane_groups
from ..triton.trace_backward import BackwardTrace
from .inputs import OneHead
from .kernel_trace import check_trace_dtype
from .step import Step, StepKind

__all__ = ["KERNEL_SOURCE", "NOTE", "KernelBackwardTrace", "check_traceable", "kernel_blocks", "run_backward_trace"]

KERNEL_SOURCE = "triton/kernels/backward_dkdv.py and backward_dq.py, their trace build: TRACE=True"
NOTE = (
    "The production backward kernels' numbers (their trace build) beside the reference's, at the kernels' tiles, "
    "from the reference's O and lse. Why they differ: "
    "(1) exp2 and the folded scale: the kernels recompute P_ij = exp2(S_ij * qk_scale - lse_i * log2(e)) with "
    "qk_scale = scale * log2(e), one FFMA a score, where the reference takes exp(scale Q_i K_j^T - lse_i). "
    "(2) The operand dtype: P_ij and dS_ij are cast to the inputs' dtype before their MMAs (dV_j += P^T dO, "
    "dK_j += dS^T Q, dQ_i += dS K); the trace shows dS as that operand, so with float16 inputs dS, dV_j, dK_j and "
    "dQ_i carry float16's rounding of P or dS (about 2^-11 of each value), while P and dP stay float32. "
    "(3) The scale's place: the two-kernel backward multiplies dK_j and dQ_i by scale once at the end (shown "
    "scaled here); the one-kernel backward scales dS first. "
    "(4) The tile order: a program adds its tiles in increasing i (dK/dV) or j (dQ), and a dot sums in its own "
    "order. "
    "(5) The atomics' order: the one-kernel backward adds each dQ partial into dQ by an atomic add; dQ_i after a "
    "step is the sum of the partials that reached dQ before it, in their arrival order (in the interpreter "
    "increasing j; on a GPU any), so the sum's rounding, and with it dQ's last bits, moves from run to run."
)
TERMS = {
    StepKind.DKDV: ("P_ij", "dP_ij", "dS_ij", "dV_j", "dK_j"),
    StepKind.DQ: ("P_ij", "dP_ij", "dS_ij", "dQ_i"),
}


def kernel_blocks(block_m: int, block_n: int) -> tuple[int, int]:
    """The kernels' tiles for a replay's ``(block_m, block_n)``: each rounded up to a power of two >= 16."""
    return block_d(block_m), block_d(block_n)


def check_traceable(head: OneHead, q: Tensor) -> None:
    """A named error for what the backward's trace build does not trace (the launcher's own refusals, said for a
    replay's keywords); ``q`` as given (its dtype and device)."""
    asked = [*head.options.mask.variants, *(["sinks"] if head.sink is not None else [])]
    if asked:
        raise AttentionValueError(
            f'source="triton": the backward kernels\' trace build traces plain and causal attention only; this call '
            f"asks for {asked}: leave them out, or use the default source='reference'"
        )
    if lane_groups(head.q.shape[-1])[1] > 0:
        raise AttentionValueError(
            f'source="triton": a head dim of {head.q.shape[-1]} runs as two lane groups, which the trace build '
            "does not trace: use D <= 128"
        )
    check_trace_dtype(q)


def _launch_module() -> Any:
    """``triton.launch``, its kernels imported in Triton's interpreter on a machine without a GPU (the flag is read
    when the kernels are decorated, so it must be set before their modules' first import)."""
    if "flashattn_teach.triton.kernels.backward_dkdv" not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from ..triton import launch

    return launch


@dataclass(frozen=True)
class KernelBackwardTrace:
    """One traced backward of one head: its buffer (on the CPU), the scale, whether it ran as one kernel (dQ by
    atomics), and the head dims."""

    trace: BackwardTrace
    scale: float
    fused: bool
    D: int
    D_v: int

    def _dkdv(self, i: int, j: int, step: Step) -> dict[str, Tensor]:
        """Record ``(j, i)`` of the dK/dV program, back in the reference's layout ``(Br, Bc)`` and units."""
        (r0, r1), (c0, c1) = step.rows, step.cols
        BM, BD = self.trace.block_m, self.trace.BLOCK_D
        rec = self.trace.dkdv()[j, i, : c1 - c0].double()  # (Bc, W): key rows
        if torch.isnan(rec[0, 0]):
            raise AttentionValueError(f"the dK/dV kernel did not visit tile (i, j) = ({i}, {j}), which the replay does")
        Br = r1 - r0
        dS_scale = self.scale if self.fused else 1.0  # the one-kernel backward's dS comes scaled
        dK_scale = 1.0 if self.fused else self.scale  # the two-kernel backward scales dK_j at the end
        return {
            "P_ij": rec[:, :Br].T,  # (Bc, Br) -> (Br, Bc)
            "dP_ij": rec[:, BM : BM + Br].T,
            "dS_ij": rec[:, 2 * BM : 2 * BM + Br].T / dS_scale,
            "dV_j": rec[:, 3 * BM + BD : 3 * BM + BD + self.D_v],  # (Bc, D_v)
            "dK_j": rec[:, 3 * BM : 3 * BM + self.D] * dK_scale,  # (Bc, D)
        }

    def order(self, i: int, j: int) -> int | None:
        """The place (0, 1, ...) at which the one-kernel backward's dQ partial of tile ``(i, j)`` reached dQ; None
        without atomics or for a tile not traced."""
        if not self.fused:
            return None
        at = float(self.trace.partials()[j, i, 0, -1])
        return None if math.isnan(at) else int(at)

    def arrivals(self) -> list[tuple[int, int, int]]:
        """``(i, j, order)`` of every dQ partial added by atomics, in arrival order; empty without atomics."""
        tiles = [(i, j, self.order(i, j)) for i in range(self.trace.T_r) for j in range(self.trace.T_c)]
        return sorted(((i, j, n) for i, j, n in tiles if n is not None), key=lambda t: t[2])

    def dq_summed(self, i: int, js: list[int]) -> Tensor:
        """Query block ``i``'s dQ rows had its partials arrived in the order ``js`` (key blocks): summed in float32
        in that order, as the atomic adds would sum them. ``(BLOCK_M, D)``; what a different order does to dQ."""
        parts = [self.trace.partials()[j, i, :, : self.D] for j in js]  # each (BLOCK_M, D), float32
        total = parts[0].clone()
        for part in parts[1:]:
            total = total + part
        return total

    def order_moves_dq(self) -> float | None:
        """``max |dQ - dQ'|`` over the query blocks, dQ summed in the traced arrival order and dQ' in its reverse:
        how far the atomics' order alone moves dQ; None without atomics."""
        if not self.fused:
            return None
        moved = 0.0
        for i in range(self.trace.T_r):
            js = [j for a, j, _ in self.arrivals() if a == i]
            if js:
                moved = max(moved, float((self.dq_summed(i, js) - self.dq_summed(i, js[::-1])).abs().max()))
        return moved

    @functools.cached_property
    def _dq_after(self) -> dict[tuple[int, int], Tensor]:
        """Per tile ``(i, j)``, dQ's rows of query block ``i`` just after its partial arrived: the block's partials
        that came no later, summed in float32 in arrival order, as the atomic adds summed them. ``(BLOCK_M, D)``."""
        running: dict[int, Tensor] = {}
        after = {}
        for i, j, _ in self.arrivals():
            part = self.trace.partials()[j, i, :, : self.D]  # (BLOCK_M, D), float32
            running[i] = part.clone() if i not in running else running[i] + part
            after[(i, j)] = running[i]
        return after

    def terms(self, step: Step) -> dict[str, Tensor]:
        """The kernels' terms of a dK/dV or dQ step (:data:`TERMS`), float64, by the reference's names."""
        i, j, (r0, r1), (c0, c1) = step.i, step.j, step.rows, step.cols
        if step.step_kind is StepKind.DKDV:
            return self._dkdv(i, j, step)
        if self.fused:
            kv = self._dkdv(i, j, step)
            dQ = self._dq_after[(i, j)][: r1 - r0].double()
            return {"P_ij": kv["P_ij"], "dP_ij": kv["dP_ij"], "dS_ij": kv["dS_ij"], "dQ_i": dQ}
        BN, BD = self.trace.block_n, self.trace.BLOCK_D
        rec = self.trace.dq()[i, j, : r1 - r0].double()  # (Br, W'): query rows
        if torch.isnan(rec[0, 0]):
            raise AttentionValueError(f"the dQ kernel did not visit tile (i, j) = ({i}, {j}), which the replay does")
        Bc = c1 - c0
        return {
            "P_ij": rec[:, :Bc],
            "dP_ij": rec[:, BN : BN + Bc],
            "dS_ij": rec[:, 2 * BN : 2 * BN + Bc],
            "dQ_i": rec[:, 3 * BN + BD : 3 * BN + BD + self.D] * self.scale,  # scaled once at the end
        }


def run_backward_trace(
    inputs: tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor],
    *,
    causal: bool,
    causal_align: str,
    scale: float,
    block_m: int,
    block_n: int,
    deterministic: bool,
) -> KernelBackwardTrace:
    """Run the backward kernels' trace build on one head: ``inputs = (q (N_q, D), k (N_k, D), v (N_k, D_v), O
    (N_q, D_v), lse (N_q,), dO (N_q, D_v))``, all but ``lse`` (float32) in the kernels' dtype."""
    launch = _launch_module()
    q, k, v, O, lse, dO = inputs
    (N_q, D), (N_k, D_v) = q.shape, v.shape
    s = AttentionShapes(batch=(1,), H_q=1, H_kv=1, N_q=N_q, N_k=N_k, D=D, D_v=D_v, rank=4, scale=scale)
    trace = BackwardTrace.allocate(s, block_m, block_n, device=q.device)
    config = AttentionConfig.uniform(block_m, block_n)
    q4, k4, v4, O4, dO4 = (t.reshape(1, 1, *t.shape).contiguous() for t in (q, k, v, O, dO))  # (1, 1, N, .)
    lse3 = lse.reshape(1, 1, N_q).float().contiguous()
    launch.backward(
        q4, k4, v4, O4, lse3, dO4, None, s, causal=causal, causal_align=causal_align, config=config,
        deterministic=deterministic, trace=trace,
    )  # fmt: skip
    on_cpu = BackwardTrace(trace.buffer.cpu(), trace.T_r, trace.T_c, block_m, block_n, trace.BLOCK_D, trace.BLOCK_DV)
    return KernelBackwardTrace(on_cpu, scale, fused_backward(config, deterministic, N_q), D, D_v)
