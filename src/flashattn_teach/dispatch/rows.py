"""One query per head on the CPU paths: the query heads that share a key/value head run as rows of it.

A decode step through the drop-in (a Hugging Face model's ``generate``) attends one new query per head
over the whole cache, ``q (B, H_q, 1, D)``. Run as it stands, each of the ``B x H_q`` heads is a task of
one row whose Python costs more than its arithmetic, and every key tile is read ``G = H_q / H_kv`` times.
When nothing tells the ``G`` query heads of a key/value head apart but their query vectors, they run as
``G`` rows of that head instead, a view (query head ``h = h_kv G + g``, as grouped-query attention pairs
them)::

    q (B, H_kv G, 1, D)  ->  q (B, H_kv, G, D),     O (B, H_kv, G, D_v)  ->  O (B, H_kv G, 1, D_v)

That holds when the one row's mask does not depend on its position or its head: causal masking and the
window hide no key from it (bottom-right causal: the single row is the last and sees every key; with
``seqlens_k``, every one of its own batch element's ``seqlens_k[b]``), no ALiBi (a slope per head), no
dropout (its counters name the head and the row), and an ``attn_mask`` whose head size is 1 or ``H_q``
(read as ``(B, H_kv, G, N_k)``). flash-attn does the same when decoding; for
``flash_attention_with_kvcache`` it is :func:`flashattn_teach.decode.ranges.decode_one`.
"""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from .._options import AttentionOptions
from ..masks.spec import MaskSpec


def _folded_mask(attn_mask: Tensor | None, H_q: int, H_kv: int, G: int) -> Tensor | bool | None:
    """The mask of the folded call, broadcast to ``(B, H_kv, G, N_k)``; ``False`` if it cannot fold."""
    if attn_mask is None:
        return None
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))  # (b, h, 1, N_k), torch's rules
    b, h, _, N_k = m.shape
    if h == 1:
        return m.expand(b, 1, G, N_k)  # every query head reads the same row
    if h == H_q:
        return m.reshape(b, H_kv, G, N_k)  # head h_kv G + g's row becomes row g of head h_kv
    return False


def _sees_every_key(spec: MaskSpec, N_k: int) -> bool:
    """Whether causal masking and the window leave the one row of every batch element all of its keys
    ``[0, L_b)``: the row sits at key position ``off_b`` (``L_b - 1`` under ``bottom_right``, per element
    with ``seqlens_k``) and sees ``off_b - left <= j <= off_b + right``."""
    lengths = spec.seqlens_k.reshape(-1).tolist() if spec.per_element and spec.seqlens_k is not None else [N_k]
    for b, n in enumerate(lengths):
        off, last = spec.offset_of(b), n - 1
        if (spec.causal and off < last) or (spec.left >= 0 and off - spec.left > 0):
            return False
        if spec.right >= 0 and off + spec.right < last:
            return False
    return True


def fold(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions) -> tuple[Tensor, AttentionOptions] | None:
    """``(q (B, H_kv, G, D), options of that call)`` when the call's query heads can run as rows (module
    docs), else None. The rows' options are these options with the rows' shapes and mask; nothing is
    checked again."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[2] != 1 or not q.shape[0] == k.shape[0] == v.shape[0]:
        return None
    B, H_q, _, D = q.shape
    H_kv = opts.shapes.H_kv  # after broadcasting: key and value heads may differ when one of them is 1
    if H_kv == 0 or H_q <= H_kv or H_q % H_kv:
        return None
    spec = opts.mask
    if not _sees_every_key(spec, k.shape[2]) or spec.alibi_slopes is not None:
        return None
    if spec.packed is not None:
        return None
    if opts.dropout_p > 0.0 or opts.sinks is not None:  # a sink per query head, as ALiBi's slope
        return None
    G = H_q // H_kv
    mask = _folded_mask(opts.attn_mask, H_q, H_kv, G)
    if mask is False:
        return None
    shapes = replace(opts.shapes, H_q=H_kv, N_q=G)  # (B, H_kv, G, D): G rows per key/value head
    rows = MaskSpec.build(
        shapes,
        q.dtype,
        causal=False,
        causal_align="top_left",
        softcap=spec.softcap,
        seqlens_k=spec.seqlens_k,
        attn_mask=mask if isinstance(mask, Tensor) else None,
    )
    return q.reshape(B, H_kv, G, D), opts.with_rows(shapes, rows)


def unfold(O: Tensor, lse: Tensor, H_q: int) -> tuple[Tensor, Tensor]:
    """``O (B, H_kv, G, D_v)``, ``lse (B, H_kv, G)`` of the folded call as ``(B, H_q, 1, D_v)``, ``(B, H_q, 1)``."""
    B = O.shape[0]
    return O.reshape(B, H_q, 1, O.shape[3]), lse.reshape(B, H_q, 1)
