"""One call's options: the keywords the public functions take, written once, and the record they are
validated into, once, for whichever backend runs the call.

The keywords are ``TypedDict`` s (:class:`StepKeywords`, :class:`PackedKeywords`, :class:`AttentionKeywords`,
:class:`DecodeKeywords`), each key with its type and default on one line. A ``TypedDict`` rather than the
options record itself, because the two hold different things: the keywords are what a user writes (``causal``,
``window``, ``attn_mask`` as given), the record is what they mean for these ``q, k, v`` (the broadcast sizes,
the resolved ``scale``, the mask contract); and a ``TypedDict`` is what ``**options: Unpack[...]`` (PEP 692)
lets mypy and IDEs read as a signature, which a dataclass is not. Each public function takes them so
(:func:`flashattn_teach._validate.keywords.takes_keywords` gives it the signature ``help()`` shows and the
unknown-keyword error) and passes them whole to :func:`make_options`, which checks every argument, once; every
backend reads the frozen :class:`AttentionOptions` it returns, so no backend validates again or receives an
untyped ``**dict``. The variations of a call that the library runs below a public function (the query heads of
a decode step folded into rows, one key range of a decode step, a dropout key fixed by a compiled op) are
built from it with ``replace``-style methods that check nothing again. torch's and flash-attn's drop-ins keep
their own written-out signatures (their peers'), and spell the keywords into :func:`make_options` by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Annotated, Any, cast

from torch import Tensor
from typing_extensions import Required, TypedDict, Unpack

from ._layout import compute_dtype
from ._validate.fp8 import Fp8Descale, is_fp8
from ._validate.inputs import (
    AttentionShapes,
    check_alibi_slopes,
    check_bool,
    check_dropout,
    check_seqlens_k,
    check_softcap,
    check_window,
    validate_inputs,
)
from ._validate.keywords import Default, keyword_table, unexpected_keyword
from ._validate.plain import plain_key
from ._validate.sinks import check_sinks
from ._validate.varlen import (
    PackedBounds,
    check_cu_seqlens,
    check_max_seqlen,
    check_packed_alibi,
    check_packed_qkv,
    check_same_batch,
)
from .dropout import DropoutKey, draw
from .errors import AttentionTypeError, AttentionValueError
from .flex import block_mask as flex_block_mask
from .flex.mods import BlockMask, MaskMod, ScoreMod, UserMods, check_block_mask
from .masks.spec import MaskSpec


class StepKeywords(TypedDict, total=False):
    """What every call takes, a decode step's too: the scores' scale and terms, and which keys a row sees.
    (``flash_attention``'s docstring says what each means.)"""

    causal: Annotated[bool, Default(False)]
    scale: Annotated[float | None, Default(None)]  # None: 1 / sqrt(D)
    window: Annotated[tuple[int, int] | None, Default(None)]  # (left, right), -1: unbounded
    softcap: Annotated[float | None, Default(None)]
    alibi_slopes: Annotated[Tensor | None, Default(None)]
    sinks: Annotated[Tensor | None, Default(None)]  # (H_q,)


class PackedKeywords(StepKeywords, total=False):
    """What a prefill call takes over packed sequences too (``flash_attention_varlen``)."""

    causal_align: Annotated[str, Default("top_left")]  # or "bottom_right"; the varlen functions default to it
    dropout_p: Annotated[float, Default(0.0)]
    deterministic: Annotated[bool, Default(False)]  # a bitwise reproducible backward


class AttentionKeywords(PackedKeywords, total=False):
    """What a call over a padded batch takes too (``flash_attention``, ``explain``, the references)."""

    enable_gqa: Annotated[bool, Default(False)]  # flash_attention: True
    seqlens_k: Annotated[Tensor | None, Default(None)]
    attn_mask: Annotated[Tensor | None, Default(None)]
    score_mod: Annotated[ScoreMod | None, Default(None)]
    mask_mod: Annotated[MaskMod | None, Default(None)]
    block_mask: Annotated[BlockMask | None, Default(None)]


class DecodeKeywords(StepKeywords, total=False):
    """A decode step's keywords (``flash_attention_with_kvcache``, ``explain_with_kvcache``)."""

    cache_seqlens: Required[Tensor | int]
    block_table: Annotated[Tensor | None, Default(None)]  # (B, max_blocks): a paged cache
    cache_leftpad: Annotated[Tensor | None, Default(None)]  # (B,)
    num_splits: Annotated[int, Default(0)]  # 0: chosen
    backend: Annotated[str, Default("auto")]


_ATTENTION = {name: p.default for name, p in keyword_table(AttentionKeywords).items()}


@dataclass(frozen=True)
class AttentionOptions:
    """Everything about a call except ``q, k, v`` themselves, one field per fact.

    ``shapes`` carries the broadcast sizes and the resolved ``scale``; ``mask`` is the call's mask contract
    (causal, window, softcap, ALiBi, ``seqlens_k``, packed sequences, ``attn_mask``; see
    :mod:`flashattn_teach.masks`), which every backend reads; ``causal_align`` is how the causal diagonal
    was placed (the contract holds its offset). ``dropout_key`` is the call's dropout
    (:mod:`flashattn_teach.dropout`): drawn by :meth:`with_dropout` where the call runs (not by ``explain``,
    which draws nothing), and kept for the backward, which regenerates the mask from it. ``deterministic``
    asks for a bitwise reproducible backward (flash-attn's argument; the CPU backends always are).
    ``descale``: an FP8 call's dequantisation factors (:mod:`flashattn_teach._validate.fp8`), None otherwise.
    ``sinks``: the call's attention sinks, ``(H_q,)`` or None (:mod:`flashattn_teach._validate.sinks`),
    one logit per query head that every row's softmax counts as one more key, of value zero.
    """

    shapes: AttentionShapes
    mask: MaskSpec
    causal_align: str = "top_left"
    enable_gqa: bool = False
    dropout_p: float = 0.0
    dropout_key: DropoutKey | None = None
    deterministic: bool = False
    descale: Fp8Descale | None = None
    sinks: Tensor | None = None

    @property
    def scale(self) -> float:
        return self.shapes.scale

    @property
    def causal(self) -> bool:
        return self.mask.causal

    @property
    def attn_mask(self) -> Tensor | None:
        """The user's mask, checked to broadcast to the scores (with leading 1s to the scores' rank)."""
        return self.mask.attn_mask

    @property
    def dropout(self) -> DropoutKey:
        """The dropout every path applies: the drawn key, or ``DropoutKey()`` (none) when ``dropout_p = 0``."""
        if self.dropout_key is not None:
            return self.dropout_key
        if self.dropout_p > 0.0:
            raise RuntimeError("dropout_p > 0 but no dropout key was drawn: run the call on opts.with_dropout()")
        return DropoutKey()

    def with_dropout(self, key: DropoutKey | None = None) -> AttentionOptions:
        """These options with the call's dropout key: ``key`` if given (tests and the compiled ops fix one),
        the one already drawn, or one drawn now from torch's default generator
        (:func:`flashattn_teach.dropout.draw`, which consumes nothing when ``dropout_p = 0``), so
        ``torch.manual_seed`` makes calls repeatable."""
        if key is None:
            if self.dropout_key is not None or self.dropout_p == 0.0:
                return self
            key = draw(self.dropout_p)
        return replace(self, dropout_p=key.p, dropout_key=key)

    def with_sinks(self, sinks: Tensor | None) -> AttentionOptions:
        """These options with another tensor of the same sinks (an autograd function's own input, which
        torch.func may wrap); nothing is checked again."""
        return replace(self, sinks=sinks)

    @cached_property
    def memo(self) -> dict[tuple[object, ...], Any]:
        """Answers that depend only on these options and the key each is kept under (the planner's plan of a
        plain call, :func:`flashattn_teach.dispatch.planner.plan`). :func:`make_options` returns one record
        for the same plain call over and over (:func:`flashattn_teach._validate.plain.plain_key`), so a
        model's next call finds them here. Not a field: a record rebuilt by ``replace`` (the rewrites of
        ``dispatch/carry.py``) starts empty."""
        return {}

    def with_rows(self, shapes: AttentionShapes, mask: MaskSpec) -> AttentionOptions:
        """These options for the same keys read by other query rows (``shapes`` and ``mask`` of those rows,
        as :mod:`flashattn_teach.dispatch.rows` builds them); nothing is checked again."""
        return replace(self, shapes=shapes, mask=mask, enable_gqa=True)


def make_options(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    call: StepKeywords | None = None,
    /,
    *,
    packed: tuple[Tensor, Tensor] | None = None,
    offset: int | None = None,
    causal_name: str = "causal",
    descale: Fp8Descale | None = None,
    **keywords: Unpack[AttentionKeywords],
) -> AttentionOptions:
    """Validate a call's arguments (naming them as the caller's signature does) and freeze them.

    ``call``: a public function's keywords, passed whole (keys it has that are not :class:`AttentionKeywords`'
    are not read); ``keywords``: any of them by name, which replace the call's (the defaults fill the rest).
    ``packed``: ``(cu_seqlens_q, cu_seqlens_k)``, already checked
    (:mod:`flashattn_teach._validate.varlen`), for the ``(H, total, D)`` views of packed sequences; the
    ALiBi slopes are then per sequence, checked by the caller too. ``offset`` fixes the causal diagonal's
    offset itself (a decode step's key range; see :meth:`flashattn_teach.masks.MaskSpec.build`).
    ``descale``: an FP8 call's factors, already checked (:func:`flashattn_teach._validate.fp8.check_fp8`)."""
    if not _ATTENTION.keys() >= keywords.keys():
        raise unexpected_keyword("make_options", next(iter(keywords.keys() - _ATTENTION.keys())), frozenset(_ATTENTION))
    o = cast(AttentionKeywords, {**_ATTENTION, **(call or {}), **keywords})
    key = (
        None if packed is not None or offset is not None or descale is not None else plain_key(q, k, v, o, causal_name)
    )
    if key is not None:
        known = _PLAIN.get(key)
        if known is not None:
            return known
    opts = _checked(q, k, v, o, packed=packed, offset=offset, causal_name=causal_name, descale=descale)
    if key is not None:
        if len(_PLAIN) >= PLAIN_CACHE_SIZE:
            _PLAIN.clear()
        _PLAIN[key] = opts
    return opts


# The options of plain calls (no tensor, function or block mask among the keywords), by what they depend on:
# the inputs' types, dtypes, devices and shapes, and the keywords' values. A small call's checks cost more
# than its arithmetic; a model calls the same shapes over and over (benchmarks/results/cpu/host_cost.md).
PLAIN_CACHE_SIZE = 256
_PLAIN: dict[tuple[object, ...], AttentionOptions] = {}


def _checked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: AttentionKeywords,
    *,
    packed: tuple[Tensor, Tensor] | None,
    offset: int | None,
    causal_name: str,
    descale: Fp8Descale | None,
) -> AttentionOptions:
    """:func:`make_options`' checks, every one, and the record they give."""
    if descale is None and is_fp8(q):  # an e4m3 input means nothing without its descale
        raise AttentionTypeError(
            f"query is {q.dtype}: float8 inputs run in flash_attention's FP8 forward only (q_descale, k_descale, "
            "v_descale there; flashattn_teach._validate.fp8), or dequantise them to bfloat16 first"
        )
    causal = check_bool(causal_name, o["causal"])
    gqa = check_bool("enable_gqa", o["enable_gqa"])
    causal_align, attn_mask = o["causal_align"], o["attn_mask"]
    shapes = validate_inputs(q, k, v, scale=o["scale"], causal_align=causal_align, enable_gqa=gqa, attn_mask=attn_mask)
    # packed: slopes per sequence, checked by the caller (check_packed_alibi)
    alibi_slopes = o["alibi_slopes"]
    slopes = alibi_slopes if packed is not None else check_alibi_slopes(alibi_slopes, q, shapes)
    cu_q, cu_k = packed if packed is not None else (None, None)
    mods = check_mods(o["score_mod"], o["mask_mod"], o["block_mask"], shapes, q)
    mask = MaskSpec.build(
        shapes,
        q.dtype,
        causal=causal,
        causal_align=causal_align,
        window=check_window(o["window"]),
        softcap=check_softcap(o["softcap"]),
        alibi_slopes=slopes,
        seqlens_k=check_seqlens_k(o["seqlens_k"], q, shapes),
        attn_mask=attn_mask,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        offset=offset,
        mods=mods,
    )
    return AttentionOptions(
        shapes=shapes,
        mask=mask,
        causal_align=causal_align,
        enable_gqa=gqa,
        dropout_p=check_dropout(o["dropout_p"]),
        deterministic=check_bool("deterministic", o["deterministic"]),
        descale=descale,
        sinks=check_sinks(o["sinks"], shapes.H_q, q.device),
    )


def check_mods(
    score_mod: object, mask_mod: object, block_mask: object, shapes: AttentionShapes, q: Tensor
) -> UserMods | None:
    """The call's user functions (:mod:`flashattn_teach.flex.mods`), checked: callables, a block mask that
    fits the call's lengths, batch and heads, and not both ``mask_mod`` and ``block_mask`` (the block mask
    carries its own)."""
    if mask_mod is not None and block_mask is not None:
        raise AttentionValueError(
            "pass mask_mod or block_mask, not both: a block mask carries its own mask_mod "
            "(create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN))"
        )
    bm = any_length(check_block_mask(from_torch(block_mask)), shapes.N_q, shapes.N_k)
    B, H = math.prod(shapes.batch), shapes.H_q if len(shapes.score_shape) > 2 else 1
    mods = UserMods.build(score_mod, mask_mod, bm, q.device, compute_dtype(q.dtype))
    if mods is not None:
        mods.check(B, H, shapes.N_q, shapes.N_k)
    return mods


# torch's _LARGE_SPARSE_BLOCK_SIZE: a block mask of one block per row and column whatever the lengths (torch's
# flex_attention builds its no-mask default this way and skips its length check for it).
ANY_LENGTH_BLOCK = 2**30


def any_length(block_mask: Any, N_q: int, N_k: int) -> Any:
    """A block mask with ``BLOCK_SIZE = (2^30, 2^30)`` holds one block that covers any ``(N_q, N_k)``: torch
    takes it for a call of any lengths, so it is read here with the call's lengths (the same lists)."""
    bm = block_mask
    if bm is None or tuple(bm.BLOCK_SIZE) != (ANY_LENGTH_BLOCK,) * 2 or tuple(bm.seq_lengths) == (N_q, N_k):
        return bm
    return listed_again(bm, (N_q, N_k))


def from_torch(block_mask: object) -> object:
    """torch's own ``BlockMask`` (``torch.nn.attention.flex_attention.create_block_mask``'s) as this library's,
    from its index lists (the same blocks and ``mask_mod``); anything else as it is."""
    if type(block_mask).__name__ != "BlockMask" or not type(block_mask).__module__.startswith("torch."):
        return block_mask
    t: Any = block_mask
    return listed_again(t, tuple(t.seq_lengths))


def listed_again(mask: Any, seq_lengths: tuple[int, int]) -> flex_block_mask.BlockMask:
    """This library's block mask from another mask's kv index lists, ``BLOCK_SIZE`` and ``mask_mod`` (torch's
    or this library's), read for ``seq_lengths``."""
    return flex_block_mask.BlockMask.from_kv_blocks(
        mask.kv_num_blocks,
        mask.kv_indices,
        mask.full_kv_num_blocks,
        mask.full_kv_indices,
        BLOCK_SIZE=tuple(mask.BLOCK_SIZE),
        mask_mod=mask.mask_mod,
        seq_lengths=seq_lengths,
    )


def make_packed_options(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bounds: PackedBounds,
    call: StepKeywords | None = None,
    /,
    **keywords: Unpack[PackedKeywords],
) -> tuple[Tensor, Tensor, Tensor, AttentionOptions]:
    """Check a packed call (:func:`flashattn_teach.flash_attention_varlen`'s arguments: ``bounds`` its
    sequences, ``call`` its keywords passed whole, ``keywords`` by name) and return the ``(H, total, D)``
    views of ``q, k, v`` (one batch element whose sequence axis is the packed axis; no copy) with their
    options, the packed sequences in the mask contract. Only :class:`PackedKeywords` are read: a padded
    batch's (``attn_mask``, ``seqlens_k``, user functions) mean nothing here, and the caller refuses them."""
    check_packed_qkv(q, k, v)
    cu_q = check_cu_seqlens("cu_seqlens_q", bounds.cu_seqlens_q, q.shape[0], "total_q = q.shape[0]", q.device)
    cu_k = check_cu_seqlens("cu_seqlens_k", bounds.cu_seqlens_k, k.shape[0], "total_k = k.shape[0]", q.device)
    B = check_same_batch(cu_q, cu_k)
    check_max_seqlen("max_seqlen_q", bounds.max_seqlen_q, cu_q, "cu_seqlens_q")
    check_max_seqlen("max_seqlen_k", bounds.max_seqlen_k, cu_k, "cu_seqlens_k")
    if not _PACKED >= keywords.keys():
        raise unexpected_keyword("make_packed_options", next(iter(keywords.keys() - _PACKED)), _PACKED)
    o = cast(PackedKeywords, {**(call or {}), **keywords})
    slopes = check_packed_alibi(o.get("alibi_slopes"), B, q.shape[1], q.device)
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))  # (total, H, D) -> (H, total, D)
    packed_only = {name: value for name, value in o.items() if name in _PACKED}
    opts = make_options(
        qh, kh, vh, cast(PackedKeywords, packed_only), enable_gqa=True, alibi_slopes=slopes, packed=(cu_q, cu_k)
    )
    return qh, kh, vh, opts


_PACKED = frozenset(keyword_table(PackedKeywords))
