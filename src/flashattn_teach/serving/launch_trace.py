"""The decode kernel's trace build run for one query head: its records, its splits' partials and its output.

:func:`trace_decode` launches :func:`.launch.launch_decode` with a trace buffer
(:mod:`flashattn_teach.triton.kernels.trace_decode`), on copies of the caches (the step's new entries are
written into the copies, never into the caller's caches), at the key block ``block_n`` the caller asks for, and
keeps the float32 partials ``(O_s, lse_s)`` the kernel writes before its merge (with one split the kernel
writes the final ``O`` and ``lse`` itself: those are its partial). :func:`kernel_split_ranges` cuts the keys as
the kernel does, into ranges of whole key blocks.

What the trace build does not run is refused by name: paged caches, ``cache_leftpad`` and attention sinks
(the kernel folds a sink into split 0's state, where a replay merges it last).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import AttentionValueError
from ..triton.configs import arch_of, block_d
from ..triton.support import decode_unsupported_reason
from .checks import DecodeStep
from .launch import TEST_DECODE_CONFIG, append_on_device, decode_config, device_seqlens, launch_decode

__all__ = ["DecodeTrace", "import_kernel", "kernel_split_ranges", "trace_decode"]


@dataclass(frozen=True)
class DecodeTrace:
    """One traced decode step of query head ``head`` of batch element ``batch``: ``records (num_splits, blocks,
    N_new, BLOCK_N + 3 + BLOCK_DV)`` float32 (NaN where no program wrote; :mod:`..triton.kernels.trace_decode`),
    the splits' partials ``O_part (num_splits, N_new, D_v)``, ``lse_part (num_splits, N_new)`` float32, the
    merged ``O (N_new, D_v)`` (q's dtype) and ``lse (N_new,)``, on the CPU."""

    records: Tensor
    O_part: Tensor
    lse_part: Tensor
    O: Tensor
    lse: Tensor
    block_n: int
    num_splits: int


def import_kernel() -> None:
    """Import the decode kernel, in Triton's interpreter on a machine without a GPU, so that a replay can trace
    it on a CPU (the flag is read when the kernels are decorated: it must be set before their first import)."""
    if "flashattn_teach.triton.kernels.decode" not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from ..triton.kernels import decode  # noqa: F401  (decorated now, under the flag)


def kernel_split_ranges(lo: int, L: int, num_splits: int, block_n: int) -> tuple[tuple[int, int], ...]:
    """The kernel's ranges of the keys ``[lo, L)``: ``ceil(ceil((L - lo) / BLOCK_N) / num_splits)`` whole key
    blocks each from ``lo`` on, the last one short, trailing ones empty (``decode_split_fwd``)."""
    per_split = math.ceil(math.ceil((L - lo) / block_n) / num_splits) * block_n
    return tuple((min(lo + s * per_split, L), min(lo + (s + 1) * per_split, L)) for s in range(num_splits))


def check_trace_step(step: DecodeStep) -> None:
    """A named error for what the trace build does not run."""
    asked = [
        name
        for name, value in (("block_table", step.block_table), ("cache_leftpad", step.cache_leftpad))
        if value is not None
    ]
    if asked:
        raise AttentionValueError(
            f"the decode kernel's trace build runs contiguous caches only; this call passes {asked}: leave them "
            "out, or use the default source='reference'"
        )
    if step.sinks is not None:
        raise AttentionValueError(
            "the decode kernel's trace build takes no sinks: the kernel folds sink_h into split 0's state, the "
            "replay merges it after the splits, so their split terms would differ by design; leave sinks out, "
            "or use the default source='reference'"
        )


def trace_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    step: DecodeStep,
    *,
    batch: int,
    head: int,
    block_n: int,
) -> DecodeTrace:
    """Run the decode kernel's trace build on a checked step (``q (B, H_q, N_new, D)``, caches ``(B, H_kv,
    N_max, .)``), tracing query head ``head`` of batch element ``batch`` at ``BLOCK_N = block_n`` (a power of
    two >= 16); ``step.num_splits`` 0 means 1 (the CPU's choice), and it is capped as :func:`.launch.triton_decode`
    caps it."""
    check_trace_step(step)
    reason = decode_unsupported_reason(q, v_cache)
    if reason is not None:
        raise AttentionValueError(f"the decode kernel's trace build cannot run this call: {reason}")
    B, H_q, N_new, D = q.shape
    N_max, D_v = v_cache.shape[2], v_cache.shape[3]
    seqlens = device_seqlens(step.cache_seqlens, B, N_max, q.device)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()  # the step's write goes into copies
    if k is not None and v is not None:
        append_on_device(k_cache, v_cache, k, v, seqlens)
    config = decode_config(q.dtype, D, arch_of(q.device), D_v) if q.is_cuda else TEST_DECODE_CONFIG
    config = dataclasses.replace(config, BLOCK_N=block_n, num_stages=1)
    blocks = math.ceil(N_max / block_n)
    splits = max(1, min(step.num_splits or 1, blocks))
    records = torch.full((splits, blocks, N_new, block_n + 3 + block_d(D_v)), math.nan, device=q.device)
    partials = None
    if splits > 1:
        partials = (
            q.new_empty((splits, B, H_q, N_new, D_v), dtype=torch.float32),
            q.new_empty((splits, B, H_q, N_new), dtype=torch.float32),
        )
    from ..triton.kernels.trace_decode import DecodeTraceRecord

    O, lse = launch_decode(
        q,
        k_cache,
        v_cache,
        seqlens,
        0 if k is None else k.shape[2],
        causal=step.causal,
        scale=step.scale,
        window=step.window,
        softcap=step.softcap,
        alibi_slopes=step.alibi_slopes,
        num_splits=splits,
        config=config,
        trace=DecodeTraceRecord(records, batch, head, blocks),
        partials=partials,
    )
    if partials is None:  # one split: the kernel's partial is its output
        O_part, lse_part = O[batch, head][None].float(), lse[batch, head][None]
    else:
        O_part, lse_part = partials[0][:, batch, head], partials[1][:, batch, head]
    return DecodeTrace(
        records.cpu(), O_part.cpu(), lse_part.cpu(), O[batch, head].cpu(), lse[batch, head].cpu(), block_n, splits
    )
