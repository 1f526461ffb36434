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
(read as ``(B, H_kv, G, N_k)``). No ``score_mod``, ``mask_mod`` or block mask either: they see
``(b, h, q_idx, kv_idx)``, and as rows ``h`` and ``q_idx`` would change. flash-attn does the same when
decoding; for ``flash_attention_with_kvcache`` it is :func:`flashattn_teach.serving.ranges.decode_one`.

Which fields of the call's records fold carries, and when, is an allow-list (:data:`FOLD_SHAPES`,
:data:`FOLD_OPTIONS`, :data:`FOLD_MASK`; :mod:`.carry`): any other field, one added later included, keeps
the call as it is (:func:`declined` names it), so a new option can never be dropped by the fold.
"""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from .._options import AttentionOptions
from .._validate.inputs import AttentionShapes
from ..masks.spec import MaskSpec
from .carry import Carries, always, uncarried, unset


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


def _sees_every_key(spec: MaskSpec) -> bool:
    """Whether causal masking and the window leave the one row of every batch element all of its keys
    ``[0, L_b)``: the row sits at key position ``off_b`` (``L_b - 1`` under ``bottom_right``, per element
    with ``seqlens_k``) and sees ``off_b - left <= j <= off_b + right``."""
    N_k = spec.shapes.N_k
    lengths = spec.seqlens_k.reshape(-1).tolist() if spec.per_element and spec.seqlens_k is not None else [N_k]
    for b, n in enumerate(lengths):
        off, last = spec.offset_of(b), n - 1
        if (spec.causal and off < last) or (spec.left >= 0 and off - spec.left > 0):
            return False
        if spec.right >= 0 and off + spec.right < last:
            return False
    return True


def _one_row_grouped(s: AttentionShapes) -> bool:
    """One query row of 4-D inputs whose ``H_q`` query heads fall into groups of ``G > 1`` per key/value head
    (``H_kv`` after broadcasting: key and value heads may differ when one of them is 1)."""
    return s.rank == 4 and s.N_q == 1 and 0 < s.H_kv < s.H_q and s.H_q % s.H_kv == 0


# What fold carries, field by field, and when (dispatch/carry.py): every other field, and every field
# whose condition fails, makes it decline, so an option added later runs unfolded until it is listed here.
FOLD_SHAPES: Carries = {
    "batch": always,
    "H_q": _one_row_grouped,  # becomes H_kv heads of G rows each
    "H_kv": _one_row_grouped,
    "N_q": _one_row_grouped,  # becomes G
    "N_k": always,
    "D": always,
    "D_v": always,
    "rank": _one_row_grouped,
    "scale": always,
}
# The row's position (causal, the window, its offset) may go only when it hides no key; anything that
# tells the query heads apart (a slope, a mask per head that is not one per query head, a user function
# that reads h or q_idx) keeps the call as it is. The conditions assume FOLD_SHAPES' (one grouped row).
FOLD_MASK: Carries = {
    "shapes": always,  # rebuilt with FOLD_SHAPES
    "offset": _sees_every_key,  # the rows have no diagonal: offset 0, no causal, no window
    "causal": _sees_every_key,
    "left": _sees_every_key,
    "right": _sees_every_key,
    "per_element": _sees_every_key,
    "softcap": always,
    "alibi_slopes": unset("alibi_slopes"),  # a slope per query head
    "seqlens_k": always,  # per batch element, which the rows keep
    "attn_mask": lambda spec: (
        _folded_mask(spec.attn_mask, spec.shapes.H_q, spec.shapes.H_kv, spec.shapes.group) is not False
    ),
    "packed": unset("packed"),
    "dtype": always,
    "mods": unset("mods"),  # score_mod, mask_mod and block_mask see (b, h, q_idx, kv_idx): h and q_idx would change
    "_tilings": always,  # a cache of tile plans, rebuilt empty for the rows' shapes
}
FOLD_OPTIONS: Carries = {
    "shapes": always,  # rebuilt with FOLD_SHAPES
    "mask": always,  # rebuilt with FOLD_MASK
    "causal_align": always,  # the diagonal's placement is in the mask's offset, which FOLD_MASK carries
    "enable_gqa": always,  # set: the rows of a key/value head read it as grouped-query attention does
    "dropout_p": lambda o: o.dropout_p == 0.0,  # dropout's counters name the head and the row
    "dropout_key": lambda o: o.dropout_key is None or o.dropout_key.p == 0.0,
    "deterministic": always,  # the CPU paths that fold always are
    "descale": unset("descale"),  # FP8 runs its own plan
    "sinks": unset("sinks"),  # one logit per query head, as ALiBi's slope
}


def declined(opts: AttentionOptions) -> list[str]:
    """The fields that fold cannot carry, as ``shapes.<name>``, ``options.<name>`` or ``mask.<name>``; empty
    when the call folds. The shapes come first: the other conditions hold only for one grouped row."""
    for prefix, record, carries in (
        ("shapes", opts.shapes, FOLD_SHAPES),
        ("options", opts, FOLD_OPTIONS),
        ("mask", opts.mask, FOLD_MASK),
    ):
        names = uncarried(record, carries)
        if names:
            return [f"{prefix}.{name}" for name in names]
    return []


def fold(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions) -> tuple[Tensor, AttentionOptions] | None:
    """``(q (B, H_kv, G, D), options of that call)`` when every field of the call's options is one fold
    carries (:func:`declined`; module docs), else None. The rows' options are these options with the rows'
    shapes and mask, every other field as it was; nothing is checked again."""
    if not _one_row_grouped(opts.shapes):  # the first condition of declined's, asked first: it is cheap
        return None
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or not q.shape[0] == k.shape[0] == v.shape[0]:
        return None
    if declined(opts):
        return None
    B, H_q, _, D = q.shape
    H_kv, G = opts.shapes.H_kv, opts.shapes.group
    if H_q != opts.shapes.H_q:  # a query head broadcast over several key/value heads: not rows of one
        return None
    spec = opts.mask
    mask = _folded_mask(spec.attn_mask, H_q, H_kv, G)
    shapes = replace(opts.shapes, H_q=H_kv, N_q=G)  # (B, H_kv, G, D): G rows per key/value head
    rows = replace(
        spec,
        shapes=shapes,
        offset=0,
        causal=False,
        left=-1,
        right=-1,
        per_element=False,
        attn_mask=mask if isinstance(mask, Tensor) else None,
        _tilings={},
    )
    return q.reshape(B, H_kv, G, D), opts.with_rows(shapes, rows)


def unfold(O: Tensor, lse: Tensor, H_q: int) -> tuple[Tensor, Tensor]:
    """``O (B, H_kv, G, D_v)``, ``lse (B, H_kv, G)`` of the folded call as ``(B, H_q, 1, D_v)``, ``(B, H_q, 1)``."""
    B = O.shape[0]
    return O.reshape(B, H_q, 1, O.shape[3]), lse.reshape(B, H_q, 1)
