"""One decode step below :func:`flashattn_teach.flash_attention_with_kvcache`: every check, then the
in-place write of the new keys and values, then the attention, on the Triton decode kernel or the CPU
paths' key ranges (``ranges.py``). The eager public function and the decode op's body both run
:func:`decode_step`.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple

import torch
from torch import Tensor

from .._autocast import autocast_dtype
from .._layout import compute_dtype
from .._options import DecodeKeywords
from .._validate.inputs import check_bool, check_scale, check_softcap, check_window
from .._validate.sinks import check_sinks
from ..dispatch import Plan, check_backend, planner, runner
from .checks import (
    DecodeStep,
    check_cache_inputs,
    check_cache_seqlens,
    check_decode_alibi,
    check_no_grad_through_write,
    check_num_splits,
    lengths_on_host,
)
from .page_checks import (
    check_block_ids,
    check_block_table,
    check_cache_leftpad,
    check_leftpad_values,
    check_page_shapes,
    refuse_on_triton_decode,
)
from .pages import append_to_pages, element_caches
from .ranges import decode_one, merge_sinks, range_plan, visible_keys
from .splitkv import default_num_splits


def append_to_cache(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, cache_seqlens: list[int]) -> None:
    """Write ``k, v`` into the caches in place at ``[cache_seqlens[b], cache_seqlens[b] + N_new_kv)``."""
    N_new_kv = k.shape[2]
    with torch.no_grad():  # an in-place write of inference state (check_no_grad_through_write)
        for b, n in enumerate(cache_seqlens):
            k_cache[b, :, n : n + N_new_kv] = k[b]  # (H_kv, N_new_kv, D)
            v_cache[b, :, n : n + N_new_kv] = v[b]  # (H_kv, N_new_kv, D_v)


class _NothingVisible(torch.autograd.Function):
    """``(O, lse)`` of a step in which no row of any batch element sees a key, unchanged, but attached to the
    inputs it was computed from: ``O = 0`` (or the sinks' merge, ``O = 0``) and ``lse = -inf`` (or ``sink_h``)
    whatever ``q``, ``k_cache`` and ``v_cache`` hold, so their gradients are zeros, as ``flash_attention``
    with ``N_k = 0``, varlen and torch's SDPA give. Without this no range runs and ``O`` would not reach
    ``q`` at all (backward would raise). Gradients into ``O`` and ``lse`` themselves (the sinks') pass on."""

    @staticmethod
    def forward(ctx, O: Tensor, lse: Tensor, *inputs: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        ctx.like = [(t.shape, t.dtype, t.device) for t in inputs]
        return O.clone(), lse.clone()

    @staticmethod
    def backward(ctx, dO: Tensor, dlse: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        zeros = [
            torch.zeros(shape, dtype=dtype, device=device) if wanted else None
            for (shape, dtype, device), wanted in zip(ctx.like, ctx.needs_input_grad[2:], strict=True)
        ]
        return (dO, dlse, *zeros)


def attach_when_nothing_visible(
    O: Tensor,
    lse: Tensor,
    inputs: tuple[Tensor, ...],
    *,
    L: list[int],
    pads: list[int] | None,
    step: DecodeStep,
    N_new: int,
) -> tuple[Tensor, Tensor]:
    """``(O, lse)``, through :class:`_NothingVisible` when a gradient is wanted from ``inputs`` and no batch
    element has a key in reach of its rows (:func:`~.ranges.visible_keys`: ``cache_seqlens = 0`` and no new
    keys, ``cache_leftpad == cache_seqlens``, ...); with any key in reach the ranges' calls attach ``O``
    themselves (an element that sees none gets its zero gradient through ``torch.cat``)."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in inputs):
        return O, lse
    pad = pads or [0] * len(L)
    if any(lo < hi for lo, hi in (visible_keys(L_b, N_new, step.window, p) for L_b, p in zip(L, pad, strict=True))):
        return O, lse
    return _NothingVisible.apply(O, lse, *inputs)


def check_host_values(
    cache_seqlens: Tensor | int,
    block_table: Tensor | None,
    cache_leftpad: Tensor | None,
    *,
    k_cache: Tensor,
    B: int,
    N_max: int,
    N_new_kv: int,
    device: torch.device,
) -> tuple[list[int], list[int] | None]:
    """The checks that read values, all before any write: the lengths (room for the new entries), the
    block ids the step uses (``block_table``, pages ``[0, ceil(L_b / page_size))``) and ``0 <= cache_leftpad
    <= cache_seqlens``; returns the lengths and the padding. The caller runs it where the values are on the
    host (or read there anyway, as the CPU paths read the lengths)."""
    capacity = "k_cache.shape[2]" if block_table is None else "block_table.shape[1] * page_size"
    lengths = check_cache_seqlens(cache_seqlens, B, N_max, device, N_new_kv=N_new_kv, capacity=capacity)
    if block_table is not None:  # k_cache is the pool (num_blocks, H_kv, page_size, D)
        check_block_ids(block_table.cpu(), [n + N_new_kv for n in lengths], k_cache.shape[2], k_cache.shape[0])
    pads = None if cache_leftpad is None else check_leftpad_values(cache_leftpad.cpu(), lengths)
    return lengths, pads


def route_extras(backend: str, q: Tensor, k_cache: Tensor, v_cache: Tensor, *, sinks: Tensor | None) -> str:
    """The backend of a call with sinks. The Triton decode kernel takes them (and pages and padding) but is
    forward only, so a call whose sinks need a gradient that would run on it goes to the CPU paths'
    query-major reference with ``backend="auto"`` and is refused by name with ``backend="triton"``; any other
    call keeps its backend."""
    wants_grad = sinks is not None and sinks.requires_grad and torch.is_grad_enabled()
    if wants_grad and planner.plan_decode(backend, q, k_cache, v_cache).backend == "triton":
        if backend == "triton":
            refuse_on_triton_decode("is forward only, and sinks requires grad")
        return "query_major"
    return backend


class DecodeCall(NamedTuple):
    """A decode step's arguments after ``q, k_cache, v_cache``, as :func:`flash_attention_with_kvcache`
    received them: built once, by the public function (or ``explain_with_kvcache``, or from the op's
    record), and handed whole to :func:`decode_step`, ``ops.compiled_step`` and ``ops_traced.traced_step``,
    which read the keywords by name. ``autocast``: the dtype the caller's autocast cast ``q`` for, or None."""

    k: Tensor | None
    v: Tensor | None
    options: DecodeKeywords  # every keyword, its default filled; not yet checked
    return_lse: bool = False
    autocast: torch.dtype | None = None


class CheckedStep(NamedTuple):
    """A decode step after every check and before any write (:func:`check_step`): what :func:`decode_step`
    runs and ``explain_with_kvcache`` describes. ``plan``: the CPU paths' plan of every key range, None on
    the Triton decode kernel; ``lengths`` and ``pads``: ``cache_seqlens`` and ``cache_leftpad`` read on the
    host (always on the CPU paths; on the kernel's path only where they are host values already)."""

    q: Tensor
    k_cache: Tensor
    v_cache: Tensor
    k: Tensor | None
    v: Tensor | None
    step: DecodeStep
    N_max: int  # each batch element's capacity: max_blocks pages of page_size slots when paged
    lse_wanted: bool
    plan: Plan | None
    lengths: list[int] | None
    pads: list[int] | None


def check_step(q: Tensor, k_cache: Tensor, v_cache: Tensor, call: DecodeCall) -> CheckedStep:
    """Every check of a decode step, in one place for the call and ``explain_with_kvcache``: the inputs, the
    options (into one :class:`DecodeStep`), the values that are on the host, the path; on the CPU paths
    also the lengths, the number of key ranges and the plan of every range, whose refusals all come here,
    before the call writes into the caches."""
    o = call.options
    table = o["block_table"]
    q, k_cache, v_cache, k, v = check_cache_inputs(
        q, k_cache, v_cache, call.k, call.v, autocast=call.autocast, paged=table is not None
    )
    B, H_q = q.shape[:2]
    table = check_block_table(table, B, q.device)
    N_max = check_page_shapes(k_cache, table)[1] if table is not None else k_cache.shape[2]
    N_new_kv = 0 if k is None else k.shape[2]
    if k is not None and v is not None:
        check_no_grad_through_write(k_cache, v_cache, k, v)
    causal = check_bool("causal", o["causal"])
    scale = check_scale(o["scale"], q.shape[3])
    window = check_window(o["window"])
    softcap = check_softcap(o["softcap"])
    slopes = check_decode_alibi(o["alibi_slopes"], B, H_q, q.device)
    splits = check_num_splits(o["num_splits"])
    lse_wanted = check_bool("return_lse", call.return_lse)
    backend = check_backend(o["backend"])
    leftpad = check_cache_leftpad(o["cache_leftpad"], B, q.device)
    sinks = check_sinks(o["sinks"], H_q, q.device)
    cache_seqlens = o["cache_seqlens"]
    backend = route_extras(backend, q, k_cache, v_cache, sinks=sinks)
    triton = planner.plan_decode(backend, q, k_cache, v_cache).backend == "triton"
    lengths = pads = None
    if not triton or (lengths_on_host(cache_seqlens) and lengths_on_host(table) and lengths_on_host(leftpad)):
        # read on the host: the CPU paths read them anyway (a split per range, a slice per batch element),
        # the kernel's path where that costs no device sync
        lengths, pads = check_host_values(
            cache_seqlens, table, leftpad, k_cache=k_cache, B=B, N_max=N_max, N_new_kv=N_new_kv, device=q.device
        )
    elif lengths_on_host(cache_seqlens):  # the kernel's path with the table or the padding on the device
        capacity = "k_cache.shape[2]" if table is None else "block_table.shape[1] * page_size"
        check_cache_seqlens(cache_seqlens, B, N_max, q.device, N_new_kv=N_new_kv, capacity=capacity)
    if not triton:
        splits = splits or default_num_splits(q, k_cache, max(lengths) + N_new_kv if lengths else 0)
    step = DecodeStep(
        causal=causal,
        scale=scale,
        window=window,
        softcap=softcap,
        num_splits=splits,
        backend=backend,
        cache_seqlens=cache_seqlens,
        alibi_slopes=slopes,
        block_table=table,
        cache_leftpad=leftpad,
        sinks=sinks,
    )
    plan = None if triton else range_plan(q, k_cache, v_cache, step)
    return CheckedStep(q, k_cache, v_cache, k, v, step, N_max, lse_wanted, plan, lengths, pads)


def decode_step(q: Tensor, k_cache: Tensor, v_cache: Tensor, call: DecodeCall) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`flash_attention_with_kvcache` in eager mode (also inside the op), its inputs already cast for
    ``call.autocast``: every check (:func:`check_step`), then the write, then the attention."""
    c = check_step(q, k_cache, v_cache, call)
    step = c.step
    if c.plan is None:  # the Triton decode kernel, which also writes k, v into the caches
        O, lse = runner.run_decode(c.q, c.k_cache, c.v_cache, c.k, c.v, step)
        return (O, lse) if c.lse_wanted else O
    q, k_cache, v_cache, k, v = c.q, c.k_cache, c.v_cache, c.k, c.v
    lengths, pads, slopes, sinks = c.lengths or [], c.pads, step.alibi_slopes, step.sinks
    B, H_q = q.shape[:2]
    if k is not None and v is not None:
        if step.block_table is None:
            append_to_cache(k_cache, v_cache, k, v, lengths)
        elif B > 0:
            append_to_pages(k_cache, v_cache, k, v, step.block_table, lengths)
    if B == 0:  # no batch element: nothing to attend
        shape = (0, H_q, q.shape[2])
        O, lse = q.new_zeros(*shape, v_cache.shape[3]), q.new_zeros(shape, dtype=compute_dtype(q.dtype))
        return (O, lse) if c.lse_wanted else O
    N_new_kv = 0 if k is None else k.shape[2]
    L = [n + N_new_kv for n in lengths]
    caches = element_caches(k_cache, v_cache, step.block_table)
    # inputs cast above; scores and accumulators stay in the compute dtype
    with nullcontext() if autocast_dtype(q.device.type) is None else torch.autocast(q.device.type, enabled=False):
        # batch element b over its keys [leftpad[b], L[b]), one after another, every range on the plan's backend
        parts = []
        for b in range(B):  # a loop, not a comprehension: one frame fewer above every tile update
            slopes_b = None if slopes is None else slopes[b] if slopes.dim() == 2 else slopes
            parts.append(
                decode_one(
                    q if B == 1 else q[b : b + 1],
                    caches[b],
                    step,
                    plan=c.plan,
                    L=L[b],
                    alibi_slopes=slopes_b,
                    leftpad=0 if pads is None else pads[b],
                )
            )
        O, lse = parts[0] if B == 1 else (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
        if sinks is not None:  # once per row, after the ranges' merge
            O, lse = merge_sinks(O, lse, sinks)
        O = O if O.dtype == q.dtype else O.to(q.dtype)
    read = (q,) if k is not None else (q, k_cache, v_cache)  # the caches are differentiable without a write
    O, lse = attach_when_nothing_visible(O, lse, read, L=L, pads=pads, step=step, N_new=q.shape[2])
    return (O, lse) if c.lse_wanted else O
