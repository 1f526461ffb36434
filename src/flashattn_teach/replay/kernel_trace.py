"""The kernel's own numbers: a Triton kernel's trace read into the replay's steps (``source="triton"``), the
tutorial kernel's (``kernel="core"``) or the production forward's (``kernel="production"``).

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

``kernel="production"`` traces :func:`flashattn_teach.triton.kernels.forward.attn_fwd` the same way
(``launch.forward(..., trace=...)``, :mod:`flashattn_teach.triton.forward_trace`), in the same record layout, on
the whole batch with the replayed element's programs traced: at the tile its launcher takes on the device (the
interpreter's ``TEST_CONFIG``, 32 x 16; a GPU's shipped tile by pointers), with causal either way aligned and the
mask contract's variants (window, softcap, ALiBi, ``seqlens_k``, ``attn_mask``, sinks); :data:`PRODUCTION_NOTE`
says what explains its differences.
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
from .inputs import OneHead, one_head, pick_matrix
from .step import Step

__all__ = [
    "KERNELS",
    "KERNEL_TERMS",
    "NOTE",
    "PRODUCTION_NOTE",
    "KernelTrace",
    "check_traceable",
    "kernel_blocks",
    "kernel_inputs",
    "kernel_tiles",
    "production_tiles",
    "run_production_trace",
    "run_trace",
    "trace_of",
]

KERNELS = ("core", "production")  # replay(kernel=...): the tutorial kernel (core/kernel.py), or triton/kernels/

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
PRODUCTION_NOTE = (
    "The production kernel's numbers (triton/kernels/forward.py and forward_inner.py, its trace build, by "
    "pointers) beside the reference's. Why they differ: "
    "(1) exp2 and the folded scale: the kernel takes each row's maximum of the raw scores Q_i K_j^T and scales it "
    "once, m_i = max(m_i, qk_scale * rowmax) with qk_scale = scale * log2(e), and computes P_ij = exp2(S_ij * "
    "qk_scale - m_i) (one fused multiply-add on a GPU), so its m_i is in base 2; shown as m_i * ln 2 and S_ij as "
    "(S_ij * qk_scale) * ln 2. With softcap, ALiBi or an additive mask the scores are scaled and modified in base 2 "
    "first. (2) The operand dtype: P_ij is cast to V's dtype before the MMA, so with 16-bit inputs acc carries "
    "that rounding of P; on a GPU float32 inputs multiply as tf32x3. "
    "(3) The tile order: the launcher's own tiles, and its stages: with a window the key blocks its left side "
    "cuts (masked) first, then those every row sees whole (unmasked), then the causal diagonal and the short last "
    "block (masked), each in increasing j: the replay's order, but a tile the replay calls FULL may run masked."
)


def kernel_blocks(block_m: int, block_n: int) -> tuple[int, int]:
    """The kernel's tile sizes for a replay's ``(block_m, block_n)``: each rounded up to a power of two >= 16."""
    return tuple(max(16, 1 << (b - 1).bit_length()) for b in (block_m, block_n))  # type: ignore[return-value]


def kernel_tiles(head: OneHead, query_block: int, tile: tuple[int, int] | None = None) -> tuple[int, int, int, str]:
    """``(BLOCK_M, BLOCK_N, i, note)``: the kernel's tiles (``tile``, default :func:`kernel_blocks`), the query
    block ``i`` of them that holds the first row of the requested ``query_block``, and a note saying so when they
    differ from the requested tiles."""
    kernel_m, kernel_n = tile or kernel_blocks(head.block_m, head.block_n)
    r0 = query_block * head.block_m
    if (kernel_m, kernel_n) == (head.block_m, head.block_n):
        return kernel_m, kernel_n, query_block, ""
    why = "its launcher's configuration" if tile else "powers of two >= 16, tl.dot's minimum"
    note = (
        f"The kernel tiles {kernel_m} x {kernel_n} ({why}), not the requested "
        f"{head.block_m} x {head.block_n}: this replay uses the kernel's tiles, query block {r0 // kernel_m} "
        f"(the one holding row {r0})."
    )
    return kernel_m, kernel_n, r0 // kernel_m, note


def check_trace_dtype(q: Tensor) -> None:
    """A named error for an input dtype the trace builds cannot run on ``q``'s device: float64 (rounded to float32),
    float32 and float16 anywhere, bfloat16 only compiled (on a GPU)."""
    allowed = [torch.float64, torch.float32, torch.float16] + ([torch.bfloat16] if q.device.type == "cuda" else [])
    if q.dtype not in allowed:
        why = " (the interpreter multiplies bfloat16 tiles wrongly: run on a GPU)" if q.dtype == torch.bfloat16 else ""
        raise AttentionValueError(
            f'source="triton" on {q.device.type} takes {[str(d) for d in allowed]} inputs, got {q.dtype}{why}'
        )


def check_traceable(order: str, head: OneHead, q: Tensor, k: Tensor, causal_align: str, kernel: str = "core") -> None:
    """A named error for what ``kernel`` cannot trace (the tutorial kernel has no mask but causal, no sink; the
    production kernel's replay no packed sequences nor user functions; both one order); ``q, k`` as given (their
    dtype, their lengths)."""
    if kernel not in KERNELS:
        raise AttentionValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if order != "query_major":
        raise AttentionValueError(
            f'source="triton" replays the kernel\'s own order, order="query_major"; got {order!r}'
        )
    asked = [*head.options.mask.variants, *(["sinks"] if head.sink is not None else [])]
    if kernel == "production":
        asked = [name for name in asked if name in ("cu_seqlens", "block_mask", "mask_mod", "score_mod")]
        runs = "traces triton/kernels/forward.py, which replays plain, causal, window, softcap, ALiBi, seqlens_k, "
        runs += "attn_mask and sinks"
    else:
        runs = "traces core/kernel.py, which runs plain and causal attention only"
    if asked:
        raise AttentionValueError(
            f'source="triton" {runs}; this call asks for {asked}: leave them out, or use the default '
            "source='reference'"
        )
    if kernel == "core" and head.options.causal and causal_align != "top_left" and q.shape[-2] != k.shape[-2]:
        raise AttentionValueError(
            'source="triton": the kernel\'s causal mask is top-left; pass causal_align="top_left" (or '
            'kernel="production")'
        )
    if kernel == "core" and head.v.shape[-1] != head.q.shape[-1]:
        raise AttentionValueError(
            f'source="triton" needs D_v = D, got D = {head.q.shape[-1]}, D_v = {head.v.shape[-1]} (or '
            'kernel="production")'
        )
    check_trace_dtype(q)


def kernel_inputs(q: Tensor, k: Tensor, v: Tensor) -> tuple[tuple[Tensor, Tensor, Tensor], str]:
    """``q, k, v`` as the kernel takes them (float64, which it does not take, rounded to float32), and a note."""
    if q.dtype != torch.float64:
        return (q, k, v), ""
    note = "The kernel computes in float32 at most: it ran on the float64 inputs rounded to float32."
    return (q.float(), k.float(), v.float()), note


def _interpreted(module: str) -> None:
    """Triton's interpreter for ``module``'s kernels on a machine without a GPU (the flag is read when the kernels
    are decorated, so it must be set before their module's first import)."""
    if module not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _kernel_module() -> Any:
    """``core.kernel``, imported in Triton's interpreter on a machine without a GPU."""
    _interpreted("flashattn_teach.core.kernel")
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


def _production_launch(head: OneHead, q: Tensor, k: Tensor, v: Tensor) -> tuple[Any, ...]:
    """``(q4, k4, v4, variants, config, tile)``: the production forward's launch of the replayed call, all of its
    batch, ``(B, 1, N, D)`` in the kernel's dtype; a named error for what the kernels cannot run."""
    _interpreted("flashattn_teach.triton.kernels.forward")
    from ..triton import launch
    from ..triton.forward_trace import traced_tile
    from ..triton.support import call_unsupported_reason
    from ..triton.variants import KernelVariants

    opts = head.options
    q4, k4, v4 = (launch.to_4d(one_head(t), opts.shapes, 1) for t in (q, k, v))
    reason = call_unsupported_reason(q4, k4, v4, opts)
    if reason is not None:
        raise AttentionValueError(f'source="triton", kernel="production": the kernels cannot run this call: {reason}')
    variants = KernelVariants.from_spec(opts.mask, opts.dropout)
    config = launch.default_config(q4, opts.shapes, variants)
    return q4, k4, v4, variants, config, traced_tile(config, variants, fp8=False)


def production_tiles(head: OneHead, q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)``: the tile the production forward's trace build takes for this call."""
    tile = _production_launch(head, q, k, v)[-1]
    return tile.BLOCK_M, tile.BLOCK_N


def run_production_trace(head: OneHead, q: Tensor, k: Tensor, v: Tensor) -> KernelTrace:
    """Run the production forward's trace build on the call's whole batch (``q, k, v`` as given to the replay, in
    the kernel's dtype), tracing head ``(batch_index, 0)``."""
    from ..triton import launch
    from ..triton.forward_trace import forward_trace, trace_shape

    q4, k4, v4, variants, config, tile = _production_launch(head, q, k, v)
    opts, s = head.options, head.options.shapes
    shape = trace_shape(s.N_q, s.N_k, s.D_v, tile)
    buffer = torch.full(shape, math.nan, device=q.device)
    launch.forward(
        q4,
        k4,
        v4,
        s,
        causal=opts.causal,
        causal_align=opts.causal_align,
        config=config,
        variants=variants,
        sinks=None if head.sink is None else head.sink.to(device=q.device, dtype=torch.float32),
        trace=forward_trace(buffer, shape, b=head.batch_index),
    )
    return KernelTrace(buffer.cpu(), tile.BLOCK_M, tile.BLOCK_N, s.D_v)


def trace_of(
    kernel: str, head: OneHead, raw: tuple[Tensor, Tensor, Tensor], tile: tuple[int, int], causal: bool, scale: float
) -> KernelTrace:
    """The trace of ``kernel`` for the replayed call: ``raw`` its ``q, k, v`` (every batch element) in the kernel's
    dtype, ``tile`` the kernel's ``(BLOCK_M, BLOCK_N)``. The tutorial kernel runs the replayed element alone; the
    production kernel the whole batch, with the replayed element's programs traced."""
    if kernel == "production":
        return run_production_trace(head, *raw)
    q, k, v = (pick_matrix(t, n, head.batch_index) for t, n in zip(raw, ("query", "key", "value"), strict=True))
    return run_trace(q, k, v, causal, scale, *tile)
