"""The kernel's own numbers: the tutorial Triton kernel's trace read into the replay's steps (``source="triton"``).

:func:`flashattn_teach.core.kernel.triton_forward` with a ``trace`` buffer runs its trace build (``TRACE=True``):
after each key block ``j`` a program ``i`` stores its state, float32, as one record per row,

    [ s = S_ij log2(e) (BLOCK_N) | m_i (base 2) | l_i | alpha | acc, unnormalised (BLOCK_D) ]

and :class:`KernelTrace` reads record ``(i, j)`` back in the reference's units and names, so a step carries both
``step.terms`` and ``step.kernel`` (``Steps.kernel_terms``: ``S_ij, m_i, l_i, alpha, acc_new``) and
``step.kernel_diff``. The kernel works
in base 2 (``exp(x) = exp2(x log2 e)``, :data:`NOTE`), so its scores and maxima are multiplied by ``ln 2``; ``l_i``,
``alpha`` and ``acc`` are the same numbers in either base. On a CPU the kernel runs in Triton's interpreter
(``TRITON_INTERPRET=1``, set here when the kernel module is first imported), on a GPU compiled.

The kernel tiles in powers of two >= 16 (``tl.dot``'s minimum): :func:`kernel_blocks` rounds the replay's block
sizes up to those, and the replay is then made at the kernel's sizes, its query block the one holding the
requested block's first row (:func:`~.replay.kernel_replay` says so in ``Replay.note``). The kernel does plain
and causal (top-left) attention with ``D_v = D`` in float32 or float16 (float64 inputs are rounded to float32
for it; bfloat16 only compiled: the interpreter multiplies bfloat16 tiles wrongly); :func:`check_traceable`
names what else a call asks for.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..errors import AttentionValueError
from .inputs import OneHead
from .step import Step

__all__ = [
    "KERNEL_TERMS",
    "NOTE",
    "KernelTrace",
    "check_traceable",
    "kernel_blocks",
    "kernel_inputs",
    "kernel_tiles",
    "run_trace",
]

KERNEL_TERMS = ("S_ij", "m_i", "l_i", "alpha", "acc_new")  # what the trace holds, by the reference's names
LN2 = math.log(2.0)  # m_e = m_2 ln 2: the kernel's base-2 numbers back in base e
NOTE = (
    "The kernel's numbers (core/kernel.py, its trace build) beside the reference's. Why they differ: "
    "(1) exp2 and the folded scale: the kernel computes s = (Q_i K_j^T) * qk_scale with qk_scale = scale * log2(e) "
    "and P_ij = exp2(s - m), so its m_i is in base 2; shown here as m_i * ln 2 and S_ij as s * ln 2 (l_i, alpha "
    "and acc are the same in either base), off by the rounding of one more multiply. "
    "(2) The operand dtype: P_ij is cast to V's dtype before the MMA (tl.dot(p.to(v.dtype), v)), so with float16 "
    "inputs acc carries float16's rounding of P (about 2^-11 of each term), where m_i, l_i and alpha stay float32. "
    "(3) The tile order: the kernel's own tiles (powers of two >= 16), key blocks in increasing j, the unmasked "
    "ones first, then the masked (causal diagonal, short last block); a dot's sum runs in its own order."
)


def kernel_blocks(block_m: int, block_n: int) -> tuple[int, int]:
    """The kernel's tile sizes for a replay's ``(block_m, block_n)``: each rounded up to a power of two >= 16."""
    return tuple(max(16, 1 << (b - 1).bit_length()) for b in (block_m, block_n))  # type: ignore[return-value]


def kernel_tiles(head: OneHead, query_block: int) -> tuple[int, int, int, str]:
    """``(BLOCK_M, BLOCK_N, i, note)``: the kernel's tiles, the query block ``i`` of them that holds the first row
    of the requested ``query_block``, and a note saying so when they differ from the requested tiles."""
    kernel_m, kernel_n = kernel_blocks(head.block_m, head.block_n)
    r0 = query_block * head.block_m
    if (kernel_m, kernel_n) == (head.block_m, head.block_n):
        return kernel_m, kernel_n, query_block, ""
    note = (
        f"The kernel tiles {kernel_m} x {kernel_n} (powers of two >= 16, tl.dot's minimum), not the requested "
        f"{head.block_m} x {head.block_n}: this replay uses the kernel's tiles, query block {r0 // kernel_m} "
        f"(the one holding row {r0})."
    )
    return kernel_m, kernel_n, r0 // kernel_m, note


def check_traceable(order: str, head: OneHead, q: Tensor, k: Tensor, causal_align: str) -> None:
    """A named error for what the tutorial kernel cannot run (it has no mask but causal, no sink, one order);
    ``q, k`` as given (their dtype, their lengths)."""
    if order != "query_major":
        raise AttentionValueError(
            f'source="triton" replays the kernel\'s own order, order="query_major"; got {order!r}'
        )
    asked = [*head.options.mask.variants, *(["sinks"] if head.sink is not None else [])]
    if asked:
        raise AttentionValueError(
            f'source="triton" traces core/kernel.py, which runs plain and causal attention only; this call asks for '
            f"{asked}: leave them out, or use the default source='reference'"
        )
    if head.options.causal and causal_align != "top_left" and q.shape[-2] != k.shape[-2]:
        raise AttentionValueError(
            'source="triton": the kernel\'s causal mask is top-left; pass causal_align="top_left"'
        )
    if head.v.shape[-1] != head.q.shape[-1]:
        raise AttentionValueError(
            f'source="triton" needs D_v = D, got D = {head.q.shape[-1]}, D_v = {head.v.shape[-1]}'
        )
    allowed = [torch.float64, torch.float32, torch.float16] + ([torch.bfloat16] if q.device.type == "cuda" else [])
    if q.dtype not in allowed:
        why = " (the interpreter multiplies bfloat16 tiles wrongly: run on a GPU)" if q.dtype == torch.bfloat16 else ""
        raise AttentionValueError(
            f'source="triton" on {q.device.type} takes {[str(d) for d in allowed]} inputs, got {q.dtype}{why}'
        )


def kernel_inputs(q: Tensor, k: Tensor, v: Tensor) -> tuple[tuple[Tensor, Tensor, Tensor], str]:
    """``q, k, v`` as the kernel takes them (float64, which it does not take, rounded to float32), and a note."""
    if q.dtype != torch.float64:
        return (q, k, v), ""
    note = "The kernel computes in float32 at most: it ran on the float64 inputs rounded to float32."
    return (q.float(), k.float(), v.float()), note


def _kernel_module() -> Any:
    """``core.kernel``, imported in Triton's interpreter on a machine without a GPU (the flag is read when the
    kernels are decorated, so it must be set before their module's first import)."""
    if "flashattn_teach.core.kernel" not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from ..core import kernel

    return kernel


@dataclass(frozen=True)
class KernelTrace:
    """The trace buffer of one run, ``(T_r, T_c, BLOCK_M, BLOCK_N + 3 + BLOCK_D)`` float32 (NaN where no program
    wrote), and the sizes that read it."""

    buffer: Tensor
    block_m: int
    block_n: int
    D: int

    def terms(self, step: Step) -> dict[str, Tensor]:
        """Record ``(i, j)`` of ``step`` cut to its ``(Br, Bc)`` tile and ``D`` lanes, in base e, float64."""
        (r0, r1), (c0, c1), BN = step.rows, step.cols, self.block_n
        rec = self.buffer[step.i, step.j, : r1 - r0].double()  # (Br, W)
        if torch.isnan(rec[:, BN]).any():
            raise AttentionValueError(
                f"the kernel did not visit tile (i, j) = ({step.i}, {step.j}), which the replay does"
            )
        return {
            "S_ij": rec[:, : c1 - c0] * LN2,  # (Br, Bc): s = S_ij log2 e
            "m_i": rec[:, BN] * LN2,  # (Br,): base 2 -> base e
            "l_i": rec[:, BN + 1],
            "alpha": rec[:, BN + 2],  # exp2(m_old - m_new) = exp(m_old_e - m_new_e)
            "acc_new": rec[:, BN + 3 : BN + 3 + self.D],  # (Br, D)
        }

    def visited(self, i: int) -> list[int]:
        """The key blocks program ``i`` traced, in increasing ``j``."""
        return [j for j in range(self.buffer.shape[1]) if not torch.isnan(self.buffer[i, j, 0, self.block_n])]


def run_trace(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, block_m: int, block_n: int) -> KernelTrace:
    """Run the kernel's trace build on one head, ``q (N_q, D), k (N_k, D), v (N_k, D)`` in the inputs' dtype."""
    kernel = _kernel_module()
    (N_q, D), N_k = q.shape, k.shape[0]
    buffer = torch.full(kernel.trace_shape(N_q, N_k, D, block_m, block_n), math.nan, device=q.device)
    heads = (t.reshape(1, 1, *t.shape) for t in (q, k, v))  # (1, 1, N, D)
    kernel.triton_forward(*heads, causal, scale, block_m=block_m, block_n=block_n, trace=buffer)
    return KernelTrace(buffer.cpu(), block_m, block_n, D)
