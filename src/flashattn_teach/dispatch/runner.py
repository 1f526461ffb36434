"""The one place a backend is called: ``(O, lse)`` of checked inputs by the planned backend.

Every route ends here: the public functions (:mod:`flashattn_teach.api`), the compiled ops' eager bodies
(:mod:`flashattn_teach.ops`), each key range of a decode step on the CPU (:mod:`flashattn_teach.serving`),
and the ring's local blocks. Tests patch :func:`run` (and :func:`run_decode`) to see what a call runs.

    dense      flashattn_teach.reference.dense.dense_forward: all scores at once
    triton     flashattn_teach.triton: the fused kernels, the varlen launch for packed sequences
    tiled      flashattn_teach.reference.autograd.TiledAttentionFunction, at the planner's tiles (one
               ``TileLoop``), the query heads of a one-query call folded into rows of their key/value head
               (``rows.py``), and a call too small to split run as one batched tile loop
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .._options import AttentionOptions
from ..flex.block_mask_args import DEFAULT_BLOCK_SIZE
from ..flex.block_mask_build import classified_block_mask
from ..reference.autograd import (
    TiledAttentionFunction,
    TileLoop,
    differentiable,
    one_open_tile,
    open_tile,
    tensor_inputs,
)
from ..reference.dense import dense_forward
from ..reference.workers import chunk_pool
from .planner import Plan, batched, tiles, transforms_active
from .rows import fold, unfold

if TYPE_CHECKING:
    from ..serving.checks import DecodeStep


def _loop(p: Plan, opts: AttentionOptions) -> TileLoop:
    """The tile loop and tiles of a tiled backend. A threaded call too small for the pool
    (:func:`~flashattn_teach.dispatch.planner.batched`, which the plan's reason reports) runs the
    query-major loop at the same tiles instead, each tile op over every head at once with torch's threads:
    the pool's tasks would cost more than the call's arithmetic (``benchmarks/README.md`` has the
    crossover, idle and with the second core busy)."""
    mods = opts.mask.mods
    order, block_m, block_n = tiles(
        p.backend, opts.shapes.N_q, block_mask=mods is not None and "mask_mod" in mods.names
    )
    return TileLoop("query_major" if batched(p.backend, opts) else order, block_m, block_n)


def with_block_mask(opts: AttentionOptions, device: torch.device) -> AttentionOptions:
    """A call with a ``mask_mod`` but no block mask, its tiles classified once (``create_block_mask``'s
    classification at its default block size, on the worker threads on the CPU), so that every backend skips
    the tiles it hides and runs the tiles it shows whole without it; any other call as it is."""
    mods = opts.mask.mods
    s = opts.shapes
    if mods is None or mods.mask_mod is None or mods.block_mask is not None or not (s.N_q and s.N_k):
        return opts
    B, H = math.prod(s.batch), s.H_q if len(s.score_shape) > 2 else 1
    block = (DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE)
    bm = classified_block_mask(mods.mask_mod, B, H, s.N_q, s.N_k, block, device, pool=chunk_pool())
    return replace(opts, mask=replace(opts.mask, mods=replace(mods, block_mask=bm), _tilings={}))


def run(
    p: Plan, q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, with_lse: bool = True
) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of checked inputs by the planned backend; a call with dropout draws its key here, once,
    unless ``opts`` carries one already, and a ``mask_mod`` is classified here (:func:`with_block_mask`).
    ``with_lse=False``: the caller drops ``lse`` (``flash_attention`` without ``return_lse``, the SDPA
    drop-in), so a call on the one open tile that no derivative can reach skips it, and ``lse`` is then
    :data:`~flashattn_teach.reference.scores.NO_LSE` (zero elements); every other call computes it anyway.
    Positional, so that a test's recorder ``lambda p, *args: run(p, *args)`` passes it on."""
    if opts.dropout_p != 0.0 or opts.mask.mods is not None:  # a plain call has neither to add (two calls fewer)
        opts = with_block_mask(opts.with_dropout(), q.device)
    if p.backend == "dense":
        return dense_forward(q, k, v, opts)
    if p.backend == "triton":
        if opts.mask.packed is not None:
            from ..triton.varlen import triton_varlen_forward

            return triton_varlen_forward(q, k, v, opts)
        from ..triton import triton_forward

        return triton_forward(q, k, v, opts)
    # one query per head: the query heads of a key/value head as its rows (rows.py; N_q == 1 its first question)
    folded = None if opts.shapes.N_q != 1 or transforms_active() else fold(q, k, v, opts)
    q_in, opts_in = (q, opts) if folded is None else folded
    loop = _loop(p, opts_in)
    # attend()'s choice, in place (one layer fewer): the autograd function when a derivative can reach the
    # call, else its forward alone (the open tile's directly, with lse only when it is read)
    if differentiable(q_in, k, v, opts_in):
        O, lse = TiledAttentionFunction.apply(q_in, k, v, opts_in, loop, *tensor_inputs(opts_in))
    elif one_open_tile(opts_in, loop):
        O, lse = open_tile(q_in, k, v, opts_in, with_lse or folded is not None)  # unfold reads lse
    else:
        O, lse = TiledAttentionFunction.forward(q_in, k, v, opts_in, loop, opts_in.sinks)
    return (O, lse) if folded is None else unfold(O, lse, q.shape[1])


def run_decode(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None, v: Tensor | None, step: DecodeStep
) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of a checked decode step (its options the one record ``step``) by the Triton split-KV
    decode kernel, which also writes ``k, v`` into the caches, through ``step.block_table`` for paged ones
    (:func:`flashattn_teach.serving.launch.triton_decode`)."""
    from ..serving.launch import triton_decode

    return triton_decode(q, k_cache, v_cache, k, v, step)
