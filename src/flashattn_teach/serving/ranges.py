"""One decode step on the CPU paths: each batch element's keys cut into split-KV ranges, attended, merged.

:mod:`flashattn_teach.serving.api` validates, writes the new keys and values into the caches and routes; what runs
here, for
batch element ``b`` with ``L_b`` valid keys, is the module docs' picture: the keys a row can see are cut
into ``num_splits`` ranges (:func:`flashattn_teach.serving.splitkv.split_ranges`), each range is an ordinary call
of a tiled CPU path on the cache views ``[s0, s1)`` with the mask contract's diagonal offset set so that
row ``i`` sits at global key position ``L_b - N_new + i``, and the partials ``(O_s, lse_s)`` are merged
by :func:`flashattn_teach.merge_attention_states`. A range of a paged cache reads its own pages
(:mod:`.pages`); with ``cache_leftpad`` the keys start at ``cache_leftpad[b]``; sinks join once per row
after the ranges' merge (:func:`merge_sinks`). :func:`flashattn_teach.serving.step.decode_step` calls
:func:`decode_one` for each batch element, which calls the runner once per range.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .._layout import compute_dtype
from .._options import AttentionOptions
from .._validate.inputs import AttentionShapes
from ..dispatch import Plan, planner, runner
from ..dispatch.carry import Carries, always, uncarried, unset
from ..masks.spec import MaskSpec
from ..merge import merge_attention_states
from .checks import DecodeStep
from .pages import ElementCache
from .splitkv import split_ranges


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype``; a tensor already in it is returned as it is (``.to`` would cost a dispatch)."""
    return t if t.dtype == dtype else t.to(dtype)


# What a key range's options carry of the step (dispatch/carry.py): range_options puts causal, scale, window,
# softcap and each element's slopes in the mask contract, the ranges are num_splits', the plan is the
# backend's, decode_step reads the lengths and the padding on the host and merges the sinks after the ranges,
# and each element reads its own pages. A field on neither list is refused by name (check_carried) rather
# than dropped.
RANGE_CARRIES: Carries = {
    "causal": always,
    "scale": always,
    "window": always,
    "softcap": always,
    "num_splits": always,
    "backend": always,
    "cache_seqlens": always,
    "alibi_slopes": always,
    "block_table": always,
    "cache_leftpad": always,
    "sinks": always,
}
# What decode_one's rows carry when the G query heads of one new query run as G rows of their key/value
# head (the padding cuts the keys; sinks join after the merge).
ROWS_CARRIES: Carries = {
    "causal": always,  # the one query sits at L - 1, after every cached key: causal hides none of [lo, L)
    "scale": always,
    "window": always,  # the right side hides nothing before L - 1; visible_keys cuts the left side
    "softcap": always,
    "num_splits": always,
    "backend": always,
    "cache_seqlens": always,
    "alibi_slopes": unset("alibi_slopes"),  # a slope per query head: G rows of one head would share one
    "block_table": always,
    "cache_leftpad": always,
    "sinks": always,
}


def check_carried(step: DecodeStep) -> None:
    """Refuse a step with a field that the key ranges' options do not carry (:data:`RANGE_CARRIES`); called
    by :func:`range_plan`, before the call writes into the caches."""
    names = uncarried(step, RANGE_CARRIES)
    if names:
        fields = ", ".join(f"DecodeStep.{name}" for name in names)
        raise NotImplementedError(
            f"{fields} is not carried into a key range's options: add it to RANGE_CARRIES in "
            "flashattn_teach/serving/ranges.py with how range_options carries it"
        )


def range_options(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    scale: float,
    window: tuple[int, int],
    softcap: float | None,
    alibi_slopes: Tensor | None,
    offset: int,
) -> AttentionOptions:
    """The options of the rows ``q (1, H, N, D)`` over one key range ``k, v (1, H_kv, n, D)`` of checked
    inputs, with the diagonal offset that puts row ``i`` at global key position ``offset + i``
    (:mod:`flashattn_teach.serving.api`'s module docs), built without checking again; the decode-step
    replay builds its ranges' options here too."""
    _, H_q, N_q, D = q.shape
    _, H_kv, N_k, D_v = v.shape
    shapes = AttentionShapes(batch=(1,), H_q=H_q, H_kv=H_kv, N_q=N_q, N_k=N_k, D=D, D_v=D_v, rank=4, scale=scale)
    mask = MaskSpec.build(
        shapes,
        q.dtype,
        causal=causal,
        causal_align="bottom_right",
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        offset=offset,
    )
    return AttentionOptions(shapes=shapes, mask=mask, causal_align="bottom_right", enable_gqa=True)


def range_plan(q: Tensor, k_cache: Tensor, v_cache: Tensor, step: DecodeStep) -> Plan:
    """The plan of every range of every batch element, from the options of the step over the whole caches:
    the backend's refusals (``BackendUnavailableError``) all happen here, before the call writes into the
    caches, so a call that raises writes nothing."""
    # The planner reads the devices, the dtypes' kind, what requires grad and the mask's variants, not the
    # sizes: the whole caches stand for every range.
    check_carried(step)
    slopes = step.alibi_slopes
    if slopes is not None and slopes.dim() == 2:  # (B, H_q): the first element's stand for all (none: no slopes)
        slopes = slopes[0] if slopes.shape[0] else None
    opts = step_options(q, k_cache, v_cache, step, alibi_slopes=slopes, offset=0)
    return planner.plan_ranges(q, k_cache, v_cache, opts, step.backend)


def step_options(
    q: Tensor, k: Tensor, v: Tensor, step: DecodeStep, *, alibi_slopes: Tensor | None, offset: int
) -> AttentionOptions:
    """:func:`range_options` with the step's scores and mask, ``alibi_slopes`` one batch element's."""
    return range_options(
        q,
        k,
        v,
        causal=step.causal,
        scale=step.scale,
        window=step.window,
        softcap=step.softcap,
        alibi_slopes=alibi_slopes,
        offset=offset,
    )


def visible_keys(L: int, N_new: int, window: tuple[int, int], leftpad: int = 0) -> tuple[int, int]:
    """``[lo, L)``: the cache keys some row of a batch element with ``L`` keys can see. Keys before its
    padding ``leftpad`` are no keys; keys before ``L - N_new - left`` (a window's left side) are outside
    every row's window."""
    left = window[0]
    lo = 0 if left < 0 else min(max(0, L - N_new - left), L)
    return max(lo, leftpad), L


def decode_one(
    q: Tensor,
    cache: ElementCache,
    step: DecodeStep,
    *,
    plan: Plan,
    L: int,
    alibi_slopes: Tensor | None,
    leftpad: int = 0,
) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of one batch element ``q (1, H_q, N_new, D)`` over its cache keys ``[lo, L)``
    (:func:`visible_keys`: after the padding and within reach of a window's left side), in the compute
    dtype: the keys cut into ``step.num_splits`` ranges, one partial per non-empty range (flash-attn keeps
    its partial outputs in float32 too), merged.

    One new query (``N_new = 1``) sits at position ``L - 1``, after every
    cached key, so causal masking and the window's right side hide nothing of ``[lo, L)`` from it; without
    ALiBi (a slope per head) its ``G`` query heads that share a key/value head then see the same keys with
    no mask at all, and are run as ``G`` rows of one head: ``(1, H_q, 1, D) -> (1, H_kv, G, D)``
    (flash-attn's ``seqlenq_ngroups_swapped``), so each key tile is read once per key/value head, not once
    per query head, and each score tile is ``G`` rows tall."""
    _, H_q, N_new, D = q.shape
    H_kv = cache.H_kv
    G = H_q // H_kv
    lo, L = visible_keys(L, N_new, step.window, leftpad)
    rows = N_new == 1 and G > 1 and not uncarried(step, ROWS_CARRIES)
    if rows:  # every key of [lo, L) is visible to the one query, row 0 at position L - 1
        q, step, first = q.reshape(1, H_kv, G, D), replace(step, causal=False, window=(-1, -1)), L - 1
    else:
        first = L - N_new  # row 0's position
    dt = compute_dtype(q.dtype)
    qc = _cast(q, dt)
    merged: tuple[Tensor, Tensor] | None = None
    for a, b in split_ranges(L - lo, step.num_splits):
        if a == b:
            continue  # an empty range: lse = -inf for every row, which the merge would ignore
        s0, s1 = lo + a, lo + b
        # (1, H_kv, s1 - s0, D or D_v), from its pages when paged; read in q's dtype first: a no-op, or
        # autocast's cast (autocast_inputs)
        k_s, v_s = (_cast(_cast(t, q.dtype), dt) for t in cache.read(s0, s1))
        # offset = first - s0 puts row i's diagonal at global key first + i
        opts = step_options(qc, k_s, v_s, step, alibi_slopes=alibi_slopes, offset=first - s0)
        part = runner.run(plan, qc, k_s, v_s, opts)
        merged = part if merged is None else merge_attention_states(*merged, *part)
    if merged is None:  # no key to see: every row gives O = 0, lse = -inf
        shape = (*q.shape[:3], cache.D_v)
        merged = q.new_zeros(shape, dtype=dt), q.new_full(shape[:3], float("-inf"), dtype=dt)
    if rows:  # head h = h_kv G + g, as GQA reads
        O, lse = merged
        return O.reshape(1, H_q, 1, O.shape[3]), lse.reshape(1, H_q, 1)
    return merged


def merge_sinks(O: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of rows ``(B, H_q, N_new, D_v)`` over their keys, with each head's sink added once: the
    merge with a partial over one more key of score ``sink_h`` and value zero, ``(O = 0, lse = sink_h)``
    (:mod:`flashattn_teach._validate.sinks`). So ``lse = log(exp(lse) + exp(sink_h))`` and ``O`` shrinks by
    ``exp(lse_old - lse)``; a row that saw no key gets ``O = 0``, ``lse = sink_h``. Differentiable in
    ``sinks`` (the merge is)."""
    lse_sink = _cast(sinks, lse.dtype)[None, :, None].expand_as(lse)  # (H_q,) -> (B, H_q, N_new)
    return merge_attention_states(O, lse, torch.zeros_like(O), lse_sink)
