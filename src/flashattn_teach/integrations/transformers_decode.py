"""A transformers decode step on the split-KV decode kernel: one new query per row against the whole cache.

transformers hands every attention call the same contract (:mod:`.transformers`): ``query (B, H_q, N_q,
D)`` against ``key, value (B, H_kv, N_k, D)``, the cache so far, and a bool mask. In ``generate``, after the
prompt, each call is a decode step, ``N_q = 1``, and its mask is ``(B, 1, 1, N_k)``. For a left-padded batch
row ``b`` sees the keys ``[pad_b, N_k)``, with a sliding window ``[N_k - W, N_k)``, and in a static cache
(``N_k`` its capacity) the slots after the current token are hidden: every time one contiguous run of keys,
which is flash-attn's ``cache_leftpad`` and ``cache_seqlens``::

    mask[b, 0, 0]   F F T T T T F F    -> cache_leftpad[b] = 2 (the first visible key),
                    0 1 2 3 4 5 6 7       cache_seqlens[b] = 6 (one past the last)

so the step is :func:`flashattn_teach.flash_attention_with_kvcache` over those keys, on CUDA the split-KV
decode kernel rather than the prefill kernel with a mask (whose grid has ``B x H_q`` programs of one row
each). A mask row that is not one run (packed sequences, a custom 4-D mask) is not a padding:
:func:`decode_step_output` says so by returning None and the call takes the general path.
Telling the two apart reads the mask, which waits for the GPU once per call (``torch.equal``);
transformers' own flash-attention path synchronises to unpad its batches too.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..serving.api import flash_attention_with_kvcache

# Where a decode step takes the decode path. On the CPU the general path reads a bool mask tile by tile at
# about the decode path's cost, so it keeps that path; the tests add "cpu" to check the route there.
DECODE_DEVICES: tuple[str, ...] = ("cuda",)


def visible_runs(mask: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(cache_leftpad, cache_seqlens)``, int32 ``(B,)`` each, of a bool ``(B, 1, 1, N_k)`` mask whose rows
    each see one contiguous run of keys ``[cache_leftpad[b], cache_seqlens[b])``; None if some row does not
    (or sees no key)."""
    rows = mask[:, 0, 0]  # (B, N_k)
    N_k = rows.shape[-1]
    if N_k == 0:
        return None  # no key at all: the general path gives its zeros
    seen = rows.to(torch.int8)
    first = seen.argmax(-1)  # (B,): the first True (0 for a row of no True, caught below)
    end = N_k - seen.flip(-1).argmax(-1)  # (B,): one past the last True
    keys = torch.arange(N_k, device=mask.device)[None, :]  # (1, N_k)
    run = (keys >= first[:, None]) & (keys < end[:, None])  # (B, N_k)
    if not torch.equal(rows, run):  # the one read on the host
        return None
    return first.to(torch.int32), end.to(torch.int32)


def decode_step_output(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    scaling: float | None,
    softcap: float | None,
    dropout: float,
    sinks: Tensor | None,
) -> Tensor | None:
    """``O (B, H_q, 1, D_v)`` of a decode step by :func:`flash_attention_with_kvcache` when the call is one
    (one query row per batch element and head, no dropout, no gradient wanted, a mask that is None or
    shows each row one run of keys, on a device of :data:`DECODE_DEVICES`, not compiling); otherwise None, and the
    caller takes the general path."""
    if query.device.type not in DECODE_DEVICES or query.dim() != 4 or query.shape[2] != 1 or dropout:
        return None
    if torch.compiler.is_compiling():
        return None  # the mask read would break the graph; the general path is one op
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, sinks) if t is not None):
        return None  # a training step: the general path differentiates the cache too
    B, N_k = key.shape[0], key.shape[2]
    leftpad, seqlens = None, None
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool or tuple(attention_mask.shape) != (B, 1, 1, N_k):
            return None
        runs = visible_runs(attention_mask)
        if runs is None:
            return None
        leftpad, seqlens = runs
    return flash_attention_with_kvcache(
        query,
        key,
        value,
        cache_seqlens=N_k if seqlens is None else seqlens,
        cache_leftpad=leftpad,
        scale=scaling,
        softcap=softcap,
        sinks=sinks,
    )
