"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context" (arXiv:2310.01889).
Each of the W ranks holds a shard of the queries, keys and values (``N_local = N / W`` positions, in the
layout of :mod:`.layout`). The key/value shards travel around the ring: at step ``s`` rank ``r`` holds the
shard of rank ``(r - s) mod W``, computes its local queries against it, and folds the result into its
running output with the log-sum-exp merge (:func:`flashattn_teach.merge_attention_states`), the online
softmax's ``m_i, l_i`` update one level up, across devices instead of across tiles::

    lse_new = log(exp(lse_i) + exp(lse_ij))
    O_i     = exp(lse_i - lse_new) O_i + exp(lse_ij - lse_new) O_ij,     then lse_i = lse_new

The transfer of the next shard is started before the current one's attention and waited on after it, so
communication hides behind computation when a block's FLOPs outlast its bytes on the link.

Backward (the scheme of ring-flash-attention): the key/value shards go around again; with the saved
global ``lse`` and ``delta_i = rowsum(dO_i * O_i)`` each block yields its exact share of ``dQ, dK, dV``.
``dQ`` accumulates on the rank that owns the queries; the ``dK, dV`` accumulators travel with their shard
and after W hops arrive back at its owner. No rank ever holds the whole sequence's keys and values: only
its own shard, the one it computes with and the one arriving.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._layout import compute_dtype
from .._validate.inputs import check_bool, shape_str, validate_block_sizes, validate_inputs
from ..api.explain_call import explain
from ..dispatch.carry import Carries, always, uncarried
from ..errors import AttentionTypeError, AttentionValueError
from ..merge import merge_attention_states
from ..reference.defaults import DEFAULT_BLOCK_M, DEFAULT_BLOCK_N
from .blocks import LocalBackend
from .comm import CallOptions, Ring, check_same_call, signature
from .layout import BlockCall, call_tiles, check_layout, chunk_ids, ring_schedule

DEFAULT_TIMEOUT = 300.0  # seconds; generous, since the first call of a Triton kernel compiles it
KV_TAG, DKV_TAG = 0, 1  # gloo matches point-to-point messages by tag: key/value shards, dK/dV accumulators


# What the ring carries of its call into the blocks (dispatch/carry.py): a field on no list is refused by
# name (ring_attention) rather than dropped on the way to the blocks' options.
RING_CARRIES: Carries = {
    "causal": always,  # each block's from the schedule (layout.ring_schedule: full, diagonal or skipped)
    "return_lse": always,  # the ring's own output
    "layout": always,  # the schedule
    "backend": always,  # LocalBackend.name, every block's
    "scale": always,  # LocalBackend.scale, every block's
    "block_m": always,  # LocalBackend's tiles (the online reference)
    "block_n": always,
}


@dataclass
class RingStats:
    """What one rank's ring forward ran: each backend call with its block's sizes ``(call, n_q, n_k)``."""

    calls: list[tuple[BlockCall, int, int]] = field(default_factory=list)

    def tiles(self, block_m: int, block_n: int) -> int:
        """The ``block_m x block_n`` tiles those calls visit (cf. :func:`.layout.visited_tiles`)."""
        return sum(call_tiles(n_q, n_k, c.causal, block_m, block_n) for c, n_q, n_k in self.calls)


@dataclass(frozen=True)
class RingPlan:
    """Everything about one ring call that is not a tensor."""

    ring: Ring
    layout: str
    causal: bool
    local: LocalBackend
    stats: RingStats | None

    def schedule(self) -> list[list[BlockCall]]:
        return ring_schedule(self.ring.world_size, self.ring.rank, self.layout, self.causal)

    def chunk_len(self, n_local: int) -> int:
        return n_local // len(chunk_ids(self.ring.world_size, self.ring.rank, self.layout))


def _pack(a: Tensor, b: Tensor) -> Tensor:
    """Two tensors as one flat buffer, so that each ring step sends one message."""
    return torch.cat([a.reshape(-1), b.reshape(-1)])


def _unpack(buf: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Views of ``buf`` shaped like ``a`` and ``b``."""
    return buf[: a.numel()].view(a.shape), buf[a.numel() :].view(b.shape)


def ring_forward(q: Tensor, k: Tensor, v: Tensor, plan: RingPlan) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of the local queries ``q (B, H_q, N_local, D)`` over the whole sequence."""
    ring, chunk = plan.ring, plan.chunk_len(q.shape[-2])
    dt = compute_dtype(q.dtype)  # merge in fp32 at least
    O = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=dt)  # (B, H_q, N_local, D_v)
    lse = q.new_full(q.shape[:-1], float("-inf"), dtype=dt)  # (B, H_q, N_local): no key seen yet
    kv = _pack(k, v)
    for step, calls in enumerate(plan.schedule()):
        # start passing this shard on before computing with it; the last step passes nothing
        shift = ring.shift(kv, KV_TAG) if step + 1 < ring.world_size else None
        k_s, v_s = _unpack(kv, k, v)  # the shard of rank (r - step) mod W
        for call in calls:
            i, j = call.q_rows(chunk), call.k_rows(chunk)
            O_ij, lse_ij = plan.local.forward(q[..., i, :], k_s[..., j, :], v_s[..., j, :], causal=call.causal)
            O[..., i, :], lse[..., i] = merge_attention_states(O[..., i, :], lse[..., i], O_ij.to(dt), lse_ij)
            if plan.stats is not None:
                plan.stats.calls.append((call, i.stop - i.start, j.stop - j.start))
        if shift is not None:
            kv = shift.wait()
    return O.to(q.dtype), lse


def ring_backward(
    q: Tensor, k: Tensor, v: Tensor, O: Tensor, lse: Tensor, dO: Tensor, dlse: Tensor | None, plan: RingPlan
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of the local shards, from the global ``O, lse`` of the forward."""
    ring, chunk = plan.ring, plan.chunk_len(q.shape[-2])
    dt = compute_dtype(q.dtype)  # accumulate across blocks in fp32 at least
    dq = torch.zeros(q.shape, dtype=dt, device=q.device)
    kv = _pack(k, v)
    dkv_shift = None
    for step, calls in enumerate(plan.schedule()):
        kv_shift = ring.shift(kv, KV_TAG) if step + 1 < ring.world_size else None
        k_s, v_s = _unpack(kv, k, v)
        dk_s = torch.zeros(k.shape, dtype=dt, device=k.device)  # this step's share of dK, dV of shard (r - step)
        dv_s = torch.zeros(v.shape, dtype=dt, device=v.device)
        for call in calls:
            i, j = call.q_rows(chunk), call.k_rows(chunk)
            dq_ij, dk_ij, dv_ij = plan.local.backward(
                q[..., i, :],
                k_s[..., j, :],
                v_s[..., j, :],
                O[..., i, :],
                lse[..., i],
                dO[..., i, :],
                None if dlse is None else dlse[..., i],
                causal=call.causal,
            )
            dq[..., i, :] += dq_ij
            dk_s[..., j, :] += dk_ij
            dv_s[..., j, :] += dv_ij
        dkv = _pack(dk_s, dv_s)
        if dkv_shift is not None:
            # the previous rank's accumulator for the same shard: its share from the ranks before
            dkv = dkv + dkv_shift.wait()
        dkv_shift = ring.shift(dkv, DKV_TAG)  # W hops in all: the last one lands on the shard's owner
        if kv_shift is not None:
            kv = kv_shift.wait()
    assert dkv_shift is not None  # the schedule has W >= 1 steps
    dk, dv = _unpack(dkv_shift.wait(), k, v)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttentionFunction(torch.autograd.Function):
    """``(q, k, v) -> (O, lse)`` of the local shards; saves ``q, k, v, O, lse`` (no other shard)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, plan: RingPlan) -> tuple[Tensor, Tensor]:
        O, lse = ring_forward(q, k, v, plan)
        ctx.save_for_backward(q, k, v, O, lse)
        ctx.plan = plan
        # a loss of O alone passes dlse = None rather than zeros, and the backward skips delta -= dlse
        ctx.set_materialize_grads(False)
        return O, lse

    @staticmethod
    def backward(ctx: Any, dO: Tensor | None, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, O, lse = ctx.saved_tensors
        # every rank must take part in the backward's ring, even one whose loss ignores O
        dO = torch.zeros_like(O) if dO is None else dO
        dq, dk, dv = ring_backward(q, k, v, O, lse, dO, dlse, ctx.plan)
        return dq, dk, dv, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "zigzag",
    return_lse: bool = False,
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
    block_m: int | None = None,
    block_n: int | None = None,
    stats: RingStats | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention over a sequence sharded across the ranks of ``group``; call it on every rank.

    Args:
        q: ``(B, H_q, N_local, D)`` this rank's query shard, ``N_local = N / W`` positions in ``layout``
            (see :func:`.layout.shard`).
        k, v: ``(B, H_kv, N_local, D)`` and ``(B, H_kv, N_local, D_v)`` its key and value shards;
            ``H_q`` a multiple of ``H_kv`` (grouped-query attention, as :func:`flash_attention`).
        group: the process group (default: the default group); gloo for CPU tensors, NCCL for CUDA.
        causal: causal masking over the global positions (query ``i`` sees keys ``j <= i``).
        scale: softmax scale, default ``1 / sqrt(D)``.
        layout: ``"zigzag"`` (rank r holds chunks r and 2W-1-r of 2W; balanced under ``causal``; needs
            an even ``N_local``) or ``"contiguous"`` (rank r holds chunk r of W).
        return_lse: also return the global ``lse`` of the local rows, ``(B, H_q, N_local)``.
        backend: the local backend of every block (see :func:`flashattn_teach.explain`): ``"auto"`` runs
            the Triton kernels on CUDA and the CPU references otherwise.
        timeout: seconds any rank waits for another before raising :class:`.comm.RingTimeoutError`.
        block_m, block_n: tile sizes ``BLOCK_M, BLOCK_N`` of the query-major reference (``backend="query_major"``
            or ``"auto"``), forward and backward; they need not divide ``N_local``.
        stats: if given, a :class:`RingStats` that records the backend calls of the forward.

    Returns:
        ``O`` of shape ``(B, H_q, N_local, D_v)`` in ``q``'s dtype and, with ``return_lse``, ``lse``
        (float32, float64 for float64 inputs); both differentiable, the backward again a ring (every rank
        must run it). Every rank raises the same error if the ranks' shapes, dtypes or options differ.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise AttentionTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    ring = Ring.of(group, timeout)
    options = CallOptions(causal, return_lse, layout, backend, scale, block_m, block_n)
    dropped = uncarried(options, RING_CARRIES)
    if dropped:
        raise NotImplementedError(
            f"ring_attention does not carry {', '.join(dropped)} into its blocks: add it to RING_CARRIES in "
            "flashattn_teach/distributed/ring.py with how each block gets it"
        )
    check_same_call(ring, signature(q, k, v, options), q.device)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise AttentionValueError(f"{name} must be a 4-D (B, H, N_local, D) shard, got shape {shape_str(t)}")
    s = validate_inputs(q, k, v, scale=scale, enable_gqa=True)
    causal, return_lse = check_bool("causal", causal), check_bool("return_lse", return_lse)
    layout = check_layout(layout)
    if s.N_q != s.N_k:
        raise AttentionValueError(f"q and k must hold the same positions, got q {shape_str(q)} and k {shape_str(k)}")
    per_rank = len(chunk_ids(ring.world_size, ring.rank, layout))
    if s.N_q % per_rank != 0:
        raise AttentionValueError(
            f"the zigzag layout holds two equal chunks per rank, so N_local must be even; got q {shape_str(q)} "
            f"on each of {ring.world_size} ranks (use layout='contiguous', or shard a sequence of a multiple of "
            f"{2 * ring.world_size})"
        )
    if block_m is not None or block_n is not None:
        if backend not in ("auto", "query_major", "online"):  # "online": the old name
            raise AttentionValueError(
                f"block_m and block_n choose the online reference's tiles; got backend={backend!r}"
            )
        bm, bn = validate_block_sizes(block_m or DEFAULT_BLOCK_M, block_n or DEFAULT_BLOCK_N)
        local = LocalBackend("query_major", s.scale, bm, bn)
    else:
        local = LocalBackend(
            explain(q, k, v, is_causal=causal, scale=s.scale, enable_gqa=True, backend=backend).backend, s.scale
        )
    plan = RingPlan(ring, layout, causal, local, stats)
    O, lse = RingAttentionFunction.apply(q, k, v, plan)
    return (O, lse) if return_lse else O
