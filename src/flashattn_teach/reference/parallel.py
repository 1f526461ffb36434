"""Changes from core/loops.py and core/backward.py: the query-major forward and the FA2 backward with every
feature of ``query_major.py`` and ``backward.py``, run per head on a thread pool with single-threaded torch ops
(the forward folds tiles with ``online_softmax.update_`` in place; the backward calls ``tile_terms``).

The query-major forward and the FA2 backward on a pool of threads, each running single-threaded torch ops.

Same algorithms as ``query_major.py`` (Dao 2023, FlashAttention-2, Alg. 1) and ``backward.py`` (Alg. 2),
same contracts, same results to rounding; what changes is who runs the tiles. The plain references loop
over tiles in Python and let every torch op spread its tile over all cores: about fifteen small ops per
tile, each an OpenMP parallel region that ends at a barrier. When another process holds one of the cores,
every barrier waits for the descheduled thread and the whole loop slows several-fold. Here the tile loops
of different query heads run at once on a small pool of Python threads, one head (or a range of its query
rows) per task; inside a task every op runs on the worker's own core, so nothing waits for another core,
and a worker that is slowed down simply takes fewer tasks. Torch releases the GIL inside each op, so the
workers overlap except for Python's few microseconds per op.

Per head the tensors are 2-D, which lets the tile loops write into preallocated buffers (``out=``,
``addmm_``) and pre-scale ``q`` once: ``S_ij`` is the only ``Br x Bc`` tile, overwritten in place by
``P_ij``, and the online-softmax update is ``online_softmax.update_``: the equations and the ``-inf``
guard of ``online_softmax.update`` (rows that see no key end with ``O = 0`` and ``lse = -inf``), in place.
The mask contract (:mod:`flashattn_teach.masks`) is read per head: a head visits only the tiles it sees part of (a
padded
batch element skips its padding's tiles), and each tile is cut to the query rows that may see its keys.
Dropout draws each tile's keep mask from the head's ``b * H_q + h`` and the tile's global rows and columns
(``tile_dropout.py``), so the pool's split of the work never changes the mask.

The pool and its threads are in ``workers.py``.

Splitting the work:
    forward   one task per query head ``(b, h_kv, g)`` and, when there are fewer heads than tasks wanted,
              per range of its query blocks (query blocks are independent in Alg. 1);
    backward  one task per key/value head ``(b, h_kv)`` and, when there are fewer of those than tasks
              wanted, per range of its ``G`` query heads, each range accumulating into its own ``dK, dV``
              partial (at most ``G x N_k x D`` extra, the size of ``dq``), summed at the end.
Problems with fewer than ``MIN_PARALLEL_SCORES`` scores in all run inline in the calling thread, also with
single-threaded ops (through the public functions they run as one batched query-major loop instead).

Not for ``torch.func`` transforms (``vmap``, ``grad``, ``jvp``): their layers are thread-local and the
worker threads would not see them. No autograd graph is recorded; wrap the pair in an
``autograd.Function`` (as ``reference/autograd.py`` does) to differentiate.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..core.backward import tile_terms
from ..core.online_softmax import NEG_INF, finalize, init_state, update_
from ..dropout import DropoutKey
from ..flex.mods import CaptureGrads
from ..masks.spec import Tiling
from .scores import score_hook
from .tile_dropout import NO_DROPOUT, tile_dropout
from .workers import IN_WORKER, run_tasks

# Below about 2^19 scores handing tasks to threads costs about what it saves (benchmarks/README.md has the
# measurements); the dispatcher runs such calls as one batched loop instead (dispatch/runner.py).
MIN_PARALLEL_SCORES = 2**19
# Several tasks per worker, so that a worker slowed down by another process takes fewer of them instead
# of holding up the end of the call.
TASKS_PER_WORKER = 4


def _runs_inline(scores: int, workers: int) -> bool:
    return workers <= 1 or scores < MIN_PARALLEL_SCORES or getattr(IN_WORKER, "active", False)


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """``range(n)`` cut into ``parts`` contiguous, near-equal ``(start, stop)`` pieces."""
    return [(p * n // parts, (p + 1) * n // parts) for p in range(parts)]


def _tile(buf: Tensor, rows: int, cols: int) -> Tensor:
    """A contiguous ``(rows, cols)`` view of the front of the flat buffer ``buf`` (also for ragged tiles)."""
    return buf[: rows * cols].view(rows, cols)


# --------------------------------------------------------------------------------------------- forward


def parallel_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    tiling: Tiling,
    dropout: DropoutKey = NO_DROPOUT,
    sink: Tensor | None = None,
    workers: int,
) -> tuple[Tensor, Tensor]:
    """``query_major_forward`` on ``workers`` threads, same arguments: grouped layout in, grouped layout out,
    ``q (B, H_kv, G, N_q, D)``, ``k (B, H_kv, 1, N_k, D)``, ``v (B, H_kv, 1, N_k, D_v)``, ``sink (H_kv, G, 1)``
    -> ``O (B, H_kv, G, N_q, D_v)``, ``lse (B, H_kv, G, N_q)``. ``tiling`` is the call's mask contract at
    its tiles (``opts.mask.tiling(block_m, block_n)``), ``dropout`` the call's key (none by default)."""
    B, H_kv, G, N_q, _ = q.shape
    N_k, D_v = v.shape[-2], v.shape[-1]
    O = q.new_empty((B, H_kv, G, N_q, D_v))
    lse = q.new_empty((B, H_kv, G, N_q))
    inline = _runs_inline(B * H_kv * G * N_q * N_k, workers)
    heads = [(b, h, g) for b in range(B) for h in range(H_kv) for g in range(G)]
    row_blocks = math.ceil(N_q / tiling.block_m)
    parts = 1 if inline else min(row_blocks, math.ceil(TASKS_PER_WORKER * workers / max(1, len(heads))))
    sinks = None if sink is None else sink.reshape(H_kv * G)  # query head h_kv G + g's sink
    # A head is (b, h * G + g) in the mask's terms: flat batch index and query head; its dropout index is
    # b * H_q + h * G + g.
    tasks = [
        (
            q[b, h, g],
            k[b, h, 0],
            v[b, h, 0],
            O[b, h, g],
            lse[b, h, g],
            i0,
            i1,
            scale,
            tiling,
            b,
            h * G + g,
            dropout,
            (b * H_kv + h) * G + g,
            None if sinks is None else sinks[h * G + g],
        )
        for b, h, g in heads
        for i0, i1 in _split(row_blocks, parts)
    ]
    run_tasks(_forward_rows, tasks, inline=inline, workers=workers)
    return O, lse


def _forward_rows(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    O: Tensor,
    lse: Tensor,
    i0: int,
    i1: int,
    scale: float,
    tiling: Tiling,
    b: int,
    h: int,
    dropout: DropoutKey,
    bh: int,
    sink: Tensor | None = None,
) -> None:
    """FA2 Alg. 1 for query blocks ``[i0, i1)`` of one head (batch element ``b``, query head ``h``; ``bh`` is
    ``b * H_q + h``, the dropout's head index; ``sink`` its attention sink, a 0-d tensor, or None):
    ``q (N_q, D)``, ``k (N_k, D)``, ``v (N_k, D_v)``; writes those rows of ``O (N_q, D_v)`` and
    ``lse (N_q,)``."""
    if i0 >= i1:
        return
    D_v = v.shape[-1]
    N_q, N_k = q.shape[0], k.shape[0]
    spec, softcap = tiling.spec, tiling.spec.softcap
    r_start, r_end = tiling.row_blocks[i0][0], tiling.row_blocks[i1 - 1][1]
    q = q[r_start:r_end] * scale  # once per task rather than once per tile, as score_tile does
    k_T = k.t()  # (D, N_k)
    S_buf = q.new_empty(min(tiling.block_m, r_end - r_start) * min(tiling.block_n, k.shape[0]))
    for i in range(i0, i1):  # query block i
        r0, r1 = tiling.row_blocks[i]
        m_i, l_i, acc = init_state((r1 - r0,), D_v, dtype=q.dtype, device=q.device, sink=sink)
        for j in tiling.key_blocks(i, b=b, h=h):  # key block j; tiles this head sees nothing of are left out
            c0, c1 = tiling.col_blocks[j]
            # Rows outside the ones that may see key block j see nothing of it, and folding in a fully masked
            # row changes nothing: the tile is cut to those rows, and the state's views of them are updated.
            q_lo, q_hi = spec.query_range(c0, c1, b=b)
            rv, rh = max(r0, q_lo), min(r1, q_hi)
            q_i = q[rv - r_start : rh - r_start]  # (Br', D), Br' = rh - rv <= Br
            S_ij = torch.mm(q_i, k_T[:, c0:c1], out=_tile(S_buf, rh - rv, c1 - c0))  # (Br', D) @ (D, Bc)
            if softcap is not None:
                S_ij.div_(softcap).tanh_().mul_(softcap)  # softcap * tanh(S / softcap), masks.py's order
            allowed, bias = tiling.head_tile(i, j, (rv, rh), b=b, h=h, device=q.device)
            if bias is not None:
                S_ij.add_(bias)
            mod = tiling.score_mod(i, j, q.device, (rv, rh), b=b, h=h)
            if mod is not None:
                S_ij = mod(S_ij)  # the user's score_mod, after the biases, before the masks
            if allowed is not None:
                S_ij.masked_fill_(~allowed, NEG_INF)
            cut = slice(rv - r0, rh - r0)
            drop = tile_dropout(dropout, bh, (rv, rh), (c0, c1), N_q, N_k, q.device)
            update_(m_i[cut], l_i[cut], acc[cut], S_ij, v[c0:c1], drop)
        O[r0:r1], lse[r0:r1] = finalize(m_i, l_i, acc)


# -------------------------------------------------------------------------------------------- backward


def parallel_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    O: Tensor,
    lse: Tensor,
    dO: Tensor,
    dlse: Tensor | None,
    *,
    scale: float,
    tiling: Tiling,
    dropout: DropoutKey = NO_DROPOUT,
    grads: CaptureGrads | None = None,
    workers: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``backward_grouped`` on ``workers`` threads, same arguments: ``q, O, dO (B, H_kv, G, N_q, .)``,
    ``lse, dlse (B, H_kv, G, N_q)`` (``dlse`` may be None), ``k, v (B, H_kv, 1, N_k, .)`` -> ``dq, dk, dv`` in
    the same layout, ``dk, dv`` summed over the ``G`` query heads that share a key/value head. ``tiling`` as
    in :func:`parallel_forward`; ``dropout`` is the forward's key."""
    B, H_kv, G, N_q, _ = q.shape
    N_k = k.shape[-2]
    inline = _runs_inline(B * H_kv * G * N_q * N_k, workers)
    units = [(b, h) for b in range(B) for h in range(H_kv)]
    parts = 1 if inline else min(G, math.ceil(TASKS_PER_WORKER * workers / max(1, len(units))))
    dq = torch.zeros_like(q)
    # (parts, B, H_kv, 1, N_k, .): part p of a unit accumulates only its own query heads' contributions.
    dk_parts = k.new_zeros((parts, *k.shape))
    dv_parts = v.new_zeros((parts, *v.shape))
    tasks = [(b, h, p, g0, g1) for b, h in units for p, (g0, g1) in enumerate(_split(G, parts))]
    # one sum of the captured tensors' gradients per task, added up in task order: deterministic
    task_grads = {(b, h, p): grads.part() for b, h, p, _, _ in tasks} if grads is not None else {}

    def task(b, h, p, g0, g1):
        for g in range(g0, g1):
            _backward_head(
                q[b, h, g],
                k[b, h, 0],
                v[b, h, 0],
                O[b, h, g],
                lse[b, h, g],
                dO[b, h, g],
                None if dlse is None else dlse[b, h, g],
                dq[b, h, g],
                dk_parts[p, b, h, 0],
                dv_parts[p, b, h, 0],
                scale,
                tiling,
                b,
                h * G + g,
                dropout,
                (b * H_kv + h) * G + g,
                task_grads.get((b, h, p)),
            )

    run_tasks(task, tasks, inline=inline, workers=workers)
    if grads is not None:
        grads.merge([task_grads[b, h, p] for b, h, p, _, _ in tasks])
    return dq, dk_parts.sum(dim=0), dv_parts.sum(dim=0)


def _backward_head(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    O: Tensor,
    lse: Tensor,
    dO: Tensor,
    dlse: Tensor | None,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    scale: float,
    tiling: Tiling,
    b: int,
    h: int,
    dropout: DropoutKey,
    bh: int,
    grads: CaptureGrads | None = None,
) -> None:
    """FA2 Alg. 2 for one query head (batch element ``b``, query head ``h``, ``bh = b * H_q + h``):
    ``q, O, dO, dq (N_q, .)``, ``lse, dlse (N_q,)``, ``k, v, dk, dv (N_k, .)``; writes ``dq`` and adds this
    head's share to ``dk, dv`` (shared by the heads of a group). Each tile is ``core.backward.tile_terms``, cut to
    the rows that may see its keys, with the softcap, bias and score_mod of ``reference/scores.py`` and the
    forward's dropout mask ``Z`` drawn again."""
    N_q, N_k = q.shape[0], k.shape[0]
    spec, softcap = tiling.spec, tiling.spec.softcap
    has_mod = spec.mods is not None and spec.mods.score_mod is not None
    delta = (dO * O).sum(dim=-1)  # (N_q,), Alg. 2 line 4
    if dlse is not None:
        delta = delta - dlse
    for j, (c0, c1) in enumerate(tiling.col_blocks):  # key block j
        k_j, v_j, dk_j, dv_j = k[c0:c1], v[c0:c1], dk[c0:c1], dv[c0:c1]  # (Bc, .); dk_j, dv_j are views
        q_lo, q_hi = spec.query_range(c0, c1, b=b)  # rows outside see nothing of this block
        for i in tiling.query_blocks(j, b=b, h=h):  # query block i; tiles this head sees nothing of left out
            r0, r1 = tiling.row_blocks[i]
            rv, rh = max(r0, q_lo), min(r1, q_hi)  # P = 0 on the other rows, which would add nothing
            allowed, bias = tiling.head_tile(i, j, (rv, rh), b=b, h=h, device=q.device)
            rows = (rv, rh)  # S = score_mod(S) below, and dS goes back through it
            mod = (
                (lambda S, i=i, j=j, rows=rows: tiling.score_backward(i, j, S, grads, rows, b=b, h=h))
                if has_mod
                else None
            )
            drop = tile_dropout(dropout, bh, rows, (c0, c1), N_q, N_k, q.device)  # the forward's mask
            q_i, dO_i, lse_i, delta_i = q[rv:rh], dO[rv:rh], lse[rv:rh], delta[rv:rh]  # (Br', .), Br' <= Br
            hook = score_hook(softcap, bias, mod)
            t = tile_terms(q_i, k_j, v_j, dO_i, lse_i, delta_i, scale, allowed, scores=hook, drop=drop)
            dv_j.add_(t.dV)  # (Bc, D_v)
            dk_j.add_(t.dK)  # (Bc, D)
            dq[rv:rh].add_(t.dQ)  # (Br', D), Br' = rh - rv <= Br
