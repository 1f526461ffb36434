"""Autograd glue: a tiled forward and the memory-efficient backward as one differentiable function.

Saved for backward: ``q, k, v, O, lse`` only (O(N) memory); ``P`` is recomputed in ``backward``, and
so is the dropout mask, from the key the options carry (``AttentionOptions.dropout``). The
function uses the ``setup_context`` form with a generated vmap rule and a ``jvp``, so the torch.func
transforms (``grad``, ``vjp``, ``jacrev``, ``jvp``, ``vmap``) work through it as through a torch op.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.autograd import forward_ad

from .._autocast import autocast_off
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
from .scores import scale_tensor, soft_cap, whole_row
from .workers import default_workers

FORWARDS = {"query_major": query_major_forward, "key_major": key_major_forward}
ORDERS = (*FORWARDS, "parallel")
_SINKS = 5  # the sinks' place among TiledAttentionFunction's inputs: q, k, v, opts, loop, sinks, *captures


class TileLoop(NamedTuple):
    """Which tile loop runs a call and at which tiles: ``order`` in :data:`ORDERS`, ``Br = block_m`` query
    rows by ``Bc = block_n`` keys (the dispatcher's choice, :func:`flashattn_teach.dispatch.planner.tiles`)."""

    order: str
    block_m: int
    block_n: int


def grouped_sink(opts: AttentionOptions) -> Tensor | None:
    """The call's sinks ``(H_q,)`` as ``(H_kv, G, 1)`` in the compute dtype, to broadcast against the grouped
    rows ``(B, H_kv, G, Br)`` (query head ``h_kv G + g``, as ``_layout.to_grouped`` orders them)."""
    if opts.sinks is None:
        return None
    s = opts.shapes
    return opts.sinks.to(compute_dtype(opts.sinks.dtype)).reshape(s.H_kv, s.group, 1)


def differentiable(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions) -> bool:
    """Whether a derivative may pass through the call: an input (``q, k, v``, the sinks, a ``score_mod``'s
    captured tensor) requires grad in grad mode, a torch.func transform is active, or forward-mode AD has a
    dual level open (its tangents ride on the inputs). Otherwise the forward runs alone, without the
    autograd function's bookkeeping (a few tens of microseconds, most of a small call's host time)."""
    if torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0:
        return True
    if not torch.is_grad_enabled():
        return False
    if q.requires_grad or k.requires_grad or v.requires_grad:
        return True
    if opts.sinks is not None and opts.sinks.requires_grad:
        return True
    mods = opts.mask.mods
    return mods is not None and bool(mods.grad_captures)


def tensor_inputs(opts: AttentionOptions) -> tuple[Tensor | None, ...]:
    """The options' tensors that :class:`TiledAttentionFunction` takes as inputs after ``q, k, v, opts, loop``
    so that autograd gives them gradients: the sinks (or None), then a ``score_mod``'s captured tensors
    that require grad."""
    captures = () if opts.mask.mods is None else opts.mask.mods.grad_captures
    return (opts.sinks, *captures)


def attend(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, loop: TileLoop) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of validated inputs by ``loop``, with the dropout key ``opts`` carries (drawn by
    ``opts.with_dropout()``; the backward draws the mask again): :class:`TiledAttentionFunction` when a
    derivative can reach the call (:func:`differentiable`), else its forward alone. ``dispatch/runner.py``
    makes the same choice in place (one layer fewer on every call)."""
    if differentiable(q, k, v, opts):
        return TiledAttentionFunction.apply(q, k, v, opts, loop, *tensor_inputs(opts))
    return TiledAttentionFunction.forward(q, k, v, opts, loop, opts.sinks)


def one_open_tile(opts: AttentionOptions, loop: TileLoop) -> bool:
    """Whether the query-major loop would take one tile that every row sees whole (no mask, no bias, no
    dropout, no sinks: ``whole_row`` starts from ``m = -inf``) on heads that ``torch.matmul`` broadcasts as
    they stand (``H_kv`` is ``H_q`` or 1; the batch dimensions broadcast in it as in the checks): then
    :func:`open_tile` runs the call. The cheap questions first: a small call asks on every step."""
    s, spec = opts.shapes, opts.mask
    if loop.order != "query_major" or s.N_q > loop.block_m or not 0 < s.N_k <= loop.block_n:
        return False
    if spec.causal or opts.dropout_p > 0.0 or opts.sinks is not None or spec.mods is not None:
        return False
    if spec.left >= 0 or spec.right >= 0 or spec.alibi_slopes is not None or spec.seqlens_k is not None:
        return False
    if spec.attn_mask is not None or spec.packed is not None:
        return False  # what is left of MaskSpec.variants is the softcap, which the tile takes
    return s.H_kv == s.H_q or s.H_kv == 1


def open_tile(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, with_lse: bool = True) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of a call :func:`one_open_tile` admits: the loop's one step on the user layout (a small
    call's layout work and tile plan cost more than its arithmetic), in the compute dtype. ``with_lse=False``
    (a caller that drops ``lse`` and no derivative to come: ``dispatch/runner.py``) skips ``lse``'s four
    torch ops and gives :data:`~flashattn_teach.reference.scores.NO_LSE` in its place; ``O`` is the same.

    When ``q, k, v`` have the same leading dimensions (the common ``(B, H, N, D)`` call) the products are
    ``torch.bmm`` on ``(B H, N, D)`` views: the kernel ``torch.matmul`` reaches, without its expands and
    reshapes (eight torch ops a call fewer). Other layouts (one key/value head, batch broadcast, mixed ranks)
    take ``torch.matmul``'s broadcast."""
    if torch._C._is_any_autocast_enabled():  # its products run in the compute dtype (_autocast.py)
        with autocast_off(q.device.type):
            return open_tile(q, k, v, opts, with_lse)
    s = opts.shapes
    dt = compute_dtype(q.dtype)
    qc, kc, vc = (q, k, v) if q.dtype == dt else (q.to(dt), k.to(dt), v.to(dt))  # one dtype for all
    # Q scaled first, as score_tile does: q k^T may overflow where (scale q) k^T does not
    # the kept 0-d scale for plain tensors only: a subclass (FakeTensor, FunctionalTensor) refuses a real operand
    scale = scale_tensor(s.scale, dt) if type(qc) is Tensor else s.scale
    qs = qc * scale  # (.., N_q, D), a new tensor; O is written into it when it has O's shape
    lead = qs.shape[:-2]
    # one head layout, (n = B H, N, D) views of it: the scaled Q keeps q's strides (a (B, N, H, D) tensor's
    # transpose takes matmul's path, as do empty calls)
    flat = lead == kc.shape[:-2] == vc.shape[:-2] and qs.numel() > 0 and qs.is_contiguous()
    if flat:
        n = qs.numel() // (s.N_q * s.D)
        qs3, kc3, vc3 = qs.view(n, s.N_q, s.D), kc.reshape(n, s.N_k, s.D), vc.reshape(n, s.N_k, s.D_v)
        S = torch.bmm(qs3, kc3.mT)  # (n, N_q, D) @ (n, D, N_k) -> (n, N_q, N_k)
        out = qs3 if s.D == s.D_v else None  # O written into the scaled Q: two buffers a call (whole_row's note)
    else:
        qs3, vc3 = qs, vc  # heads broadcast by torch.matmul
        S = torch.matmul(qs, kc.mT)  # (.., N_q, D) @ (.., D, N_k) -> (.., N_q, N_k)
        out = qs if qs.shape == s.out_shape else None
    softcap = opts.mask.softcap
    O, lse = whole_row(S if softcap is None else soft_cap(S, softcap), vc3, out, with_lse=with_lse, bmm=flat)
    if flat:  # back to the user's leading dimensions; O is already there when written into the scaled Q
        O = qs if O is qs3 else O.view(*lead, s.N_q, s.D_v)
        lse = lse.view(*lead, s.N_q) if with_lse else lse
    return (O if O.dtype == q.dtype else O.to(q.dtype)), lse


class TiledAttentionFunction(torch.autograd.Function):
    """``(q, k, v, opts, loop, sinks, *captures) -> (O, lse)`` in the user's layout: ``O`` in ``q``'s dtype,
    ``lse`` in the compute dtype. The options and the tile loop travel whole; ``sinks`` (``opts.sinks``) and
    a ``score_mod``'s captured tensors that require grad are inputs too (:func:`tensor_inputs`), so that
    autograd gives them gradients (the forward reads them from ``opts``). Backward is
    :func:`backward_grouped` (or the parallel one), which also accepts ``dlse``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, loop: TileLoop, sinks: Tensor | None, *captures: Tensor
    ) -> tuple[Tensor, Tensor]:
        if sinks is not opts.sinks:  # a torch.func transform hands its own wrapper of the sinks
            opts = opts.with_sinks(sinks)
        s = opts.shapes
        if one_open_tile(opts, loop):
            return open_tile(q, k, v, opts)
        qg, kg, vg = to_grouped(q, k, v, s)
        tiling = opts.mask.tiling(loop.block_m, loop.block_n)
        with autocast_off(q.device.type):
            if loop.order == "parallel":
                O, lse = parallel_forward(
                    qg,
                    kg,
                    vg,
                    scale=s.scale,
                    tiling=tiling,
                    dropout=opts.dropout,
                    sink=grouped_sink(opts),
                    workers=default_workers(),
                )
            else:
                O, lse = FORWARDS[loop.order](
                    qg, kg, vg, scale=s.scale, tiling=tiling, dropout=opts.dropout, sink=grouped_sink(opts)
                )
        return from_grouped(O, s).to(q.dtype), lse_from_grouped(lse, s)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        q, k, v, opts, loop, sinks, *captures = inputs
        O, lse = output
        ctx.save_for_backward(q, k, v, O, lse, sinks)
        ctx.save_for_forward(q, k, v, O, lse, sinks)
        ctx.opts, ctx.loop, ctx.n_captures = opts, loop, len(captures)

    @staticmethod
    def backward(ctx: Any, dO: Tensor | None, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, O, lse, sinks = ctx.saved_tensors
        opts: AttentionOptions = ctx.opts
        loop: TileLoop = ctx.loop
        s = opts.shapes
        # The backward's loops need no sink: P_ij = exp(S_ij - lse_i) with the saved lse (sink included)
        # is the forward's weight, and the sink's own gradient comes from lse and delta alone.
        dsink = sink_grad(sinks, lse, O, dO, dlse) if sinks is not None and ctx.needs_input_grad[_SINKS] else None
        qg, kg, vg = to_grouped(q, k, v, s)
        dt = qg.dtype
        Og, lseg = rows_to_grouped(O, s, dt), rows_to_grouped(lse, s, dt)
        dOg = torch.zeros_like(Og) if dO is None else rows_to_grouped(dO, s, dt)
        dlseg = None if dlse is None else rows_to_grouped(dlse, s, dt)
        mods = opts.mask.mods
        if mods is not None:
            mods.check_unchanged(q.device, qg.dtype)  # the backward calls score_mod again
        grads = CaptureGrads(mods.grad_captures) if mods is not None and ctx.n_captures else None
        tiling = opts.mask.tiling(loop.block_m, loop.block_n)
        with autocast_off(q.device.type):
            # With create_graph=True (double backward) the backward itself must be differentiable: the
            # query-major backward is plain torch ops in this thread; the parallel one runs in worker threads
            # under no_grad.
            if loop.order == "parallel" and not torch.is_grad_enabled():
                dq, dk, dv = parallel_backward(
                    qg,
                    kg,
                    vg,
                    Og,
                    lseg,
                    dOg,
                    dlseg,
                    scale=s.scale,
                    tiling=tiling,
                    dropout=opts.dropout,
                    grads=grads,
                    workers=default_workers(),
                )
            else:
                dq, dk, dv = backward_grouped(
                    qg, kg, vg, Og, lseg, dOg, dlseg, scale=s.scale, tiling=tiling, dropout=opts.dropout, grads=grads
                )
        captured = () if grads is None else grads.values()
        dqkv = grad_to_input(dq, q, s), grad_to_input(dk, k, s), grad_to_input(dv, v, s)
        return (*dqkv, None, None, dsink, *captured)  # no gradient for opts and loop

    @staticmethod
    def jvp(ctx: Any, tq: Tensor | None, tk: Tensor | None, tv: Tensor | None, *rest: Any) -> tuple[Tensor, Tensor]:
        q, k, v, O, lse, sinks = ctx.saved_tensors
        tsink = rest[_SINKS - 3] if len(rest) > _SINKS - 3 else None  # rest: the tangents after tq, tk, tv
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
        loop: TileLoop = ctx.loop
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
                tiling=opts.mask.tiling(loop.block_m, loop.block_n),
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
