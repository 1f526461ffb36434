"""Autograd glue: a tiled forward and the memory-efficient backward as one differentiable function.

Saved for backward: ``q, k, v, O, lse`` only (O(N) memory); ``P`` is recomputed in ``backward``, and
so is the dropout mask, from the key the options carry (``AttentionOptions.dropout``). The
function uses the ``setup_context`` form with a generated vmap rule and a ``jvp``, so the torch.func
transforms (``grad``, ``vjp``, ``jacrev``, ``jvp``, ``vmap``) work through it as through a torch op.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .._autocast import autocast_dtype, autocast_off
from .._layout import compute_dtype, from_grouped, grad_to_input, lse_from_grouped, rows_to_grouped, to_grouped
from .._options import AttentionOptions
from ..errors import BackendUnavailableError
from ..flex.mods import CaptureGrads
from ..sinks import sink_grad
from .backward import backward_grouped
from .forward_ad import jvp_grouped
from .key_major import key_major_forward
from .parallel import parallel_backward, parallel_forward
from .query_major import query_major_forward
from .scores import score_tile, whole_row
from .workers import default_workers

FORWARDS = {"query_major": query_major_forward, "key_major": key_major_forward}
ORDERS = (*FORWARDS, "parallel")


def _forward(order: str, opts: AttentionOptions, block_m: int, block_n: int) -> Callable[..., tuple[Tensor, Tensor]]:
    """The forward of one loop order, its tiling and sinks bound in: call it with ``(q, k, v, scale=...)``."""
    sink = grouped_sink(opts)
    if order == "parallel":
        return functools.partial(parallel_forward, **_parallel_kwargs(opts, block_m, block_n), sink=sink)
    tiling = opts.mask.tiling(block_m, block_n)
    return functools.partial(FORWARDS[order], tiling=tiling, dropout=opts.dropout, sink=sink)


def grouped_sink(opts: AttentionOptions) -> Tensor | None:
    """The call's sinks ``(H_q,)`` as ``(H_kv, G, 1)`` in the compute dtype, to broadcast against the grouped
    rows ``(B, H_kv, G, Br)`` (query head ``h_kv G + g``, as ``_layout.to_grouped`` orders them)."""
    if opts.sinks is None:
        return None
    s = opts.shapes
    return opts.sinks.to(compute_dtype(opts.sinks.dtype)).reshape(s.H_kv, s.group, 1)


def _backward(
    order: str, opts: AttentionOptions, block_m: int, block_n: int, grads: CaptureGrads | None
) -> Callable[..., tuple[Tensor, ...]]:
    """The backward of one loop order, its tiling bound in (see :func:`_forward`); ``grads`` collects the
    gradients of a ``score_mod``'s captured tensors."""
    if order == "parallel":
        return functools.partial(parallel_backward, **_parallel_kwargs(opts, block_m, block_n), grads=grads)
    tiling = opts.mask.tiling(block_m, block_n)
    return functools.partial(backward_grouped, tiling=tiling, dropout=opts.dropout, grads=grads)


def _parallel_kwargs(opts: AttentionOptions, block_m: int, block_n: int) -> dict[str, Any]:
    return dict(
        causal=opts.causal,
        causal_align=opts.causal_align,
        block_m=block_m,
        block_n=block_n,
        workers=default_workers(),
        mask=opts.mask,
        dropout=opts.dropout,
    )


def _one_open_tile(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, block_m: int, block_n: int) -> bool:
    """Whether the query-major loop would take one tile that every row sees whole (no mask, no bias, no
    dropout) on inputs whose heads broadcast as they stand (``H_kv`` is ``H_q`` or 1, one batch shape)."""
    s, spec = opts.shapes, opts.mask
    if not (0 < s.N_k <= block_n and s.N_q <= block_m) or spec.causal or opts.dropout_p > 0.0:
        return False
    if opts.sinks is not None:  # whole_row starts from m = -inf; the loop starts each row at its sink
        return False
    if spec.variants and spec.variants != ("softcap",):
        return False
    same = q.dim() == k.dim() == v.dim() and q.shape[:-3] == k.shape[:-3] and k.shape[:-2] == v.shape[:-2]
    return same and (q.dim() == 2 or k.shape[-3] in (q.shape[-3], 1))


def _whole_call(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions) -> tuple[Tensor, Tensor]:
    """The loop's one step on the user layout: ``S (..., H_q, N_q, N_k)`` and ``(O, lse)`` of it."""
    dt = compute_dtype(q.dtype)
    qc, kc, vc = (t if t.dtype == dt else t.to(dt) for t in (q, k, v))
    S = score_tile(qc, kc, opts.scale, softcap=opts.mask.softcap)  # (..., H_q, N_q, N_k)
    O, lse = whole_row(S, vc)
    return (O if O.dtype == q.dtype else O.to(q.dtype)), lse


def tiled_forward(
    q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, *, order: str, block_m: int, block_n: int
) -> tuple[Tensor, Tensor]:
    """User layout in, ``(O, lse)`` out: ``O`` in ``q``'s dtype, ``lse`` in the compute dtype. A call that
    one open tile holds runs that tile alone, on the user layout (a small call's layout work and tile plan
    cost more than its arithmetic)."""
    s = opts.shapes
    if order == "query_major" and _one_open_tile(q, k, v, opts, block_m, block_n):
        if autocast_dtype(q.device.type) is None:
            return _whole_call(q, k, v, opts)
        with autocast_off(q.device.type):
            return _whole_call(q, k, v, opts)
    qg, kg, vg = to_grouped(q, k, v, s)
    with autocast_off(q.device.type):
        O, lse = _forward(order, opts, block_m, block_n)(qg, kg, vg, scale=s.scale)
    return from_grouped(O, s).to(q.dtype), lse_from_grouped(lse, s)


class TiledAttentionFunction(torch.autograd.Function):
    """``(q, k, v) -> (O, lse)``; backward is :func:`backward_grouped`, which also accepts ``dlse``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        opts: AttentionOptions,
        order: str,
        block_m: int,
        block_n: int,
        sinks: Tensor | None,
        *captures: Tensor,
    ) -> tuple[Tensor, Tensor]:
        # sinks: the call's attention sinks (opts.sinks), an input so that autograd gives them dsink.
        # captures: the score_mod's captured tensors that require grad, inputs here so that autograd gives
        # them the backward's gradients; the forward reads them through the function itself
        opts = opts if sinks is None else opts.with_sinks(sinks)
        return tiled_forward(q, k, v, opts, order=order, block_m=block_m, block_n=block_n)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        q, k, v, opts, order, block_m, block_n, sinks, *captures = inputs
        ctx.n_captures = len(captures)
        O, lse = output
        ctx.save_for_backward(q, k, v, O, lse, sinks)
        ctx.save_for_forward(q, k, v, O, lse, sinks)
        ctx.opts, ctx.order, ctx.blocks = opts, order, (block_m, block_n)

    @staticmethod
    def backward(ctx: Any, dO: Tensor | None, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, O, lse, sinks = ctx.saved_tensors
        opts: AttentionOptions = ctx.opts
        s = opts.shapes
        # The backward's loops need no sink: P_ij = exp(S_ij - lse_i) with the saved lse (sink included)
        # is the forward's weight, and the sink's own gradient comes from lse and delta alone.
        dsink = sink_grad(sinks, lse, O, dO, dlse) if sinks is not None and ctx.needs_input_grad[7] else None
        qg, kg, vg = to_grouped(q, k, v, s)
        dt = qg.dtype
        Og, lseg = rows_to_grouped(O, s, dt), rows_to_grouped(lse, s, dt)
        dOg = torch.zeros_like(Og) if dO is None else rows_to_grouped(dO, s, dt)
        dlseg = None if dlse is None else rows_to_grouped(dlse, s, dt)
        # With create_graph=True (double backward) the backward itself must be differentiable: the
        # query-major backward is plain torch ops in this thread; the parallel one runs in worker threads
        # under no_grad.
        block_m, block_n = ctx.blocks
        order = "query_major" if torch.is_grad_enabled() else ctx.order
        mods = opts.mask.mods
        if mods is not None:
            mods.check_unchanged(q.device, qg.dtype)  # the backward calls score_mod again
        grads = CaptureGrads(mods.grad_captures) if mods is not None and ctx.n_captures else None
        with autocast_off(q.device.type):
            dq, dk, dv = _backward(order, opts, block_m, block_n, grads)(
                qg, kg, vg, Og, lseg, dOg, dlseg, scale=s.scale
            )
        captured = () if grads is None else grads.values()
        dqkv = grad_to_input(dq, q, s), grad_to_input(dk, k, s), grad_to_input(dv, v, s)
        return (*dqkv, None, None, None, None, dsink, *captured)

    @staticmethod
    def jvp(ctx: Any, tq: Tensor | None, tk: Tensor | None, tv: Tensor | None, *rest: Any) -> tuple[Tensor, Tensor]:
        q, k, v, O, lse, sinks = ctx.saved_tensors
        tsink = rest[4] if len(rest) > 4 else None  # after opts, order, block_m, block_n
        opts: AttentionOptions = ctx.opts
        if opts.mask.mods is not None and opts.mask.mods.score_mod is not None:
            raise BackendUnavailableError(
                "forward-mode AD through a score_mod runs on the dense path only: pass backend='dense' (or "
                "'auto', which takes it)"
            )
        s = opts.shapes
        qg, kg, vg = to_grouped(q, k, v, s)
        tqg, tkg, tvg = to_grouped(
            torch.zeros_like(q) if tq is None else tq,
            torch.zeros_like(k) if tk is None else tk,
            torch.zeros_like(v) if tv is None else tv,
            s,
        )
        dt = qg.dtype
        block_m, block_n = ctx.blocks
        with autocast_off(q.device.type):
            tO, tlse = jvp_grouped(
                qg,
                kg,
                vg,
                rows_to_grouped(O, s, dt),
                rows_to_grouped(lse, s, dt),
                tqg,
                tkg,
                tvg,
                scale=s.scale,
                tiling=opts.mask.tiling(block_m, block_n),
                dropout=opts.dropout,
            )
        tO_u, tlse_u = from_grouped(tO, s), lse_from_grouped(tlse, s)
        if sinks is not None and tsink is not None:
            # lse_i moves by p_i tsink_h (p_i = exp(sink_h - lse_i)), and O_i = sum_j exp(S_ij - lse_i) V_j by
            # -O_i times that: the sink's tangent enters through lse alone (see online_softmax.sink_grad)
            t = tsink.to(lse.dtype).reshape(-1, 1) if lse.dim() >= 2 else tsink.to(lse.dtype)
            dl = torch.where(torch.isneginf(lse), 0.0, torch.exp(sinks.to(lse.dtype).reshape(t.shape) - lse)) * t
            tlse_u = tlse_u + dl
            tO_u = tO_u - O.to(tO_u.dtype) * dl.unsqueeze(-1).to(tO_u.dtype)
        return tO_u.to(O.dtype), tlse_u
