"""The production forward's trace build on the host (issue 39): the buffer, its record, and the tile it runs.

``launch.forward(..., trace=ForwardTrace(...))`` launches :func:`~.kernels.forward.attn_fwd` with ``TRACE=True``:
the programs of head ``(b, h)`` write, after each key block ``j``, their rows' state into ``buffer[i, j]``
(:mod:`.kernels.trace` gives the record's layout, the one ``core/kernel.py``'s trace build writes). The trace build
runs the pointer path of the forward's configuration (:func:`traced_tile`: neither TMA nor warp specialisation,
whose loops hold no store of this kind) and the mask contract's variants the replay reproduces: not packed
sequences, FP8, dropout, nor FlexAttention's score_mod and block masks. With ``trace=None`` (the default) the
kernel compiles as it did before the trace build (``tests/triton/test_triton_trace_sass.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..errors import AttentionValueError
from .configs import AttentionConfig, KernelConfig
from .lanes import block_d
from .variants import KernelVariants

__all__ = ["TRACED", "ForwardTrace", "forward_trace", "trace_shape", "traced_tile"]

TRACED = (
    "plain and causal attention (either alignment), window, softcap, ALiBi, seqlens_k, attn_mask and sinks, on the "
    "pointer path"
)


class ForwardTrace(NamedTuple):
    """The trace buffer ``(T_r, T_c, BLOCK_M, BLOCK_N + 3 + BLOCK_DV)`` float32 (:func:`trace_shape`), the head
    ``(b, h)`` whose programs write it, and the buffer's strides over ``i`` and ``j`` in elements."""

    buffer: Tensor
    b: int
    h: int
    stride_i: int
    stride_j: int


def trace_shape(N_q: int, N_k: int, D_v: int, c: KernelConfig) -> tuple[int, int, int, int]:
    """One record per (query block ``i``, key block ``j``, row) of tile ``c``: ``(T_r, T_c, BLOCK_M, W)``."""
    T_r, T_c = -(-N_q // c.BLOCK_M), -(-N_k // c.BLOCK_N)
    return T_r, T_c, c.BLOCK_M, c.BLOCK_N + 3 + block_d(D_v)


def forward_trace(buffer: Tensor, want: tuple[int, int, int, int], *, b: int = 0, h: int = 0) -> ForwardTrace:
    """The record of ``buffer`` for the programs of head ``(b, h)`` (every query block ``i`` of it), checked
    against the shape ``want`` (:func:`trace_shape`)."""
    if tuple(buffer.shape) != want or buffer.dtype != torch.float32 or not buffer.is_contiguous():
        got = f"{buffer.dtype} {tuple(buffer.shape)}"
        raise AttentionValueError(f"trace.buffer must be contiguous float32 of shape {want} (trace_shape); got {got}")
    return ForwardTrace(buffer, b, h, buffer.stride(0), buffer.stride(1))


def traced_tile(config: AttentionConfig, variants: KernelVariants, fp8: bool) -> KernelConfig:
    """The forward's tile for a trace build, ``config.forward`` by pointers, or a named error for what it does
    not trace."""
    asked = (("packed sequences", variants.varlen), ("FP8", fp8), ("dropout", variants.has_dropout))
    refused = [name for name, used in (*asked, ("score_mod or a block mask", variants.user_mods)) if used]
    if refused:
        raise AttentionValueError(
            f"the forward's trace build traces {TRACED}; this call asks for {' and '.join(refused)}: leave them "
            "out, or launch without trace"
        )
    return config.forward.by_pointers()
