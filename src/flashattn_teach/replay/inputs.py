"""The replay's arguments: one batch element and one head of the caller's tensors, and checked indices.

A replay runs one head of one batch element; these helpers pick it out of the caller's inputs, and name
the argument when an index or a slope does not fit (:mod:`flashattn_teach.errors`). The forward replay
(:mod:`.replay`) and the backward replay (:mod:`.backward_replay`) check their arguments and build their mask
contract with the same :func:`one_head_call`, and build their dense oracle's mask with the same
:func:`rows_mask`, so the two cannot read the same arguments differently.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated

import torch
from torch import Tensor
from typing_extensions import Required, TypedDict

from .._layout import compute_dtype
from .._options import AttentionOptions, from_torch, make_options
from .._validate.inputs import check_window, validate_block_sizes
from .._validate.keywords import Default
from .._validate.sinks import check_sinks
from .._validate.varlen import check_cu_seqlens
from ..dispatch.carry import Carries, always, uncarried, unset
from ..errors import AttentionTypeError, AttentionValueError
from ..flex.mods import BlockMask, ScoreMod, check_block_mask
from ..masks.causal import TileKind
from ..masks.spec import MaskSpec


def pick_matrix(t: Tensor, name: str, batch_index: int) -> Tensor:
    """``(N, D)`` or ``(B, N, D)`` -> the ``(N, D)`` matrix of batch element ``batch_index`` (size 1 broadcasts)."""
    if t.dim() not in (2, 3):
        raise AttentionValueError(f"{name} must have shape (N, D) or (B, N, D), got {tuple(t.shape)}")
    return t if t.dim() == 2 else t[0 if t.shape[0] == 1 else batch_index]


def one_head(t: Tensor) -> Tensor:
    """``(N, D)`` or ``(B, N, D)`` -> ``(B, 1, N, D)``: the replay runs one head of a batch (a view)."""
    return t.reshape(1, 1, *t.shape) if t.dim() == 2 else t.unsqueeze(1)


def check_index(name: str, value: object, size: int, sizes: str) -> int:
    """``value`` as an index into ``range(size)``, else an error naming the argument and ``sizes``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise AttentionTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not 0 <= value < size:
        raise AttentionValueError(f"{name} must be in [0, {size}) for {sizes}, got {value}")
    return value


def one_slope(alibi_slopes: float | Tensor | None, B: int) -> Tensor | None:
    """One slope (a number) -> ``(1,)`` (the one head's); a ``(B,)`` tensor -> ``(B, 1)`` (per batch element).
    Anything else goes on unchanged, for ``make_options`` to name."""
    if alibi_slopes is None or (isinstance(alibi_slopes, Tensor) and alibi_slopes.shape != (B,)):
        return alibi_slopes
    if isinstance(alibi_slopes, Tensor):
        return alibi_slopes.reshape(B, 1)
    if isinstance(alibi_slopes, bool) or not isinstance(alibi_slopes, (int, float)):
        raise AttentionTypeError(
            f"alibi_slopes must be a number or a tensor of shape ({B},), got {type(alibi_slopes).__name__}"
        )
    return torch.tensor([float(alibi_slopes)], dtype=torch.float64)


def one_sink(sinks: float | Tensor | None, device: torch.device, dtype: torch.dtype) -> Tensor | None:
    """The replayed head's attention sink: a number, or a ``(1,)`` tensor (``check_sinks`` with ``H_q = 1``),
    as a ``(1,)`` tensor of the compute dtype ``dtype`` on ``device``; None stays None. A model's ``(H_q,)`` sinks
    are sliced by the caller (``sinks[h:h + 1]``), as its queries are: the replay runs one head. The value must
    be finite in ``dtype`` (``1e39`` is ``inf`` in float32, which would make every ``m_i`` infinite)."""
    if sinks is None:
        return None
    if isinstance(sinks, Tensor):
        sink = check_sinks(sinks, 1, device)
        assert sink is not None
    elif isinstance(sinks, bool) or not isinstance(sinks, (int, float)):
        raise AttentionTypeError(f"sinks must be a number or a tensor of shape (1,), got {type(sinks).__name__}")
    else:
        sink = torch.tensor([float(sinks)], dtype=torch.float64, device=device)
    given = sink.tolist()  # the replay is on the host: the value can be read
    sink = sink.to(dtype)
    if not torch.isfinite(sink).all():
        raise AttentionValueError(
            f"sinks must be finite in the compute dtype {dtype}, got {given}: {sink.tolist()} there"
        )
    return sink


def batch_size(q: Tensor, k: Tensor, v: Tensor) -> int:
    """``B``, the batch size of ``(B, N, D)`` inputs (1 for ``(N, D)``), after checking that the sizes broadcast
    and that each input is a matrix or a batch of them."""
    # validate_inputs would read (B, N, D) as (H, N, D); name the batch here so a mismatch reads as one.
    sizes = {
        name: t.shape[0]
        for t, name in ((q, "query"), (k, "key"), (v, "value"))
        if isinstance(t, Tensor) and t.dim() == 3
    }
    B = max(sizes.values(), default=1)
    if any(b not in (1, B) for b in sizes.values()):
        raise AttentionValueError(f"the batch sizes (dim 0) of query, key and value do not broadcast: {sizes}")
    for t, name in ((q, "query"), (k, "key"), (v, "value")):
        if isinstance(t, Tensor):
            pick_matrix(t, name, 0)  # the shape check, before one_head's reshape
    return B


@dataclass(frozen=True)
class OneHead:
    """The replayed head of one call, checked: batch element ``batch_index``'s matrices in the compute dtype
    (float64 for float64 inputs, float32 otherwise, as the references compute), the call's mask contract for
    ``(B, 1, N, D)``, the tile sizes and the head's sink."""

    q: Tensor  # (N_q, D)
    k: Tensor  # (N_k, D)
    v: Tensor  # (N_k, D_v)
    options: AttentionOptions  # the mask contract, batch B, one head
    batch_index: int
    block_m: int
    block_n: int
    sink: Tensor | None  # (1,), compute dtype


class ReplayKeywords(TypedDict, total=False):
    """The keywords a forward and a backward replay share, written once (:func:`.replay.replay`'s docstring says
    what each means): the tiles, the replayed batch element, and the call's mask contract and variants, as for
    :func:`flashattn_teach.flash_attention` but for one head (one ALiBi slope or sink as a number too)."""

    block_m: Required[int]
    block_n: Required[int]
    batch_index: Annotated[int, Default(0)]
    causal: Annotated[bool, Default(False)]
    causal_align: Annotated[str, Default("top_left")]
    scale: Annotated[float | None, Default(None)]  # None: 1 / sqrt(D)
    window: Annotated[tuple[int, int] | None, Default(None)]
    softcap: Annotated[float | None, Default(None)]
    alibi_slopes: Annotated[float | Tensor | None, Default(None)]  # one slope, or (B,)
    seqlens_k: Annotated[Tensor | None, Default(None)]  # (B,)
    attn_mask: Annotated[Tensor | None, Default(None)]
    cu_seqlens: Annotated[Tensor | None, Default(None)]  # (S + 1,): packed sequences
    sinks: Annotated[float | Tensor | None, Default(None)]  # the head's sink_h
    block_mask: Annotated[BlockMask | None, Default(None)]
    score_mod: Annotated[ScoreMod | None, Default(None)]


def one_head_call(q: Tensor, k: Tensor, v: Tensor, options: ReplayKeywords) -> OneHead:
    """The arguments of a replay (forward or backward) checked and picked, each error naming its argument.

    The mask contract is built as every CPU path builds it, for ``(B, 1, N, D)``: batch ``B``, one head. A 3-D
    ``attn_mask (B, N_q, N_k)`` gains the head axis; ``alibi_slopes`` is one slope or one per batch element
    (:func:`one_slope`); ``cu_seqlens`` packs sequences along the one element's sequence axis; ``score_mod`` and
    ``block_mask`` are FlexAttention's (:func:`one_head_block_mask`), called with ``h = 0``; ``sinks`` is the one
    head's (:func:`one_sink`)."""
    B = batch_size(q, k, v)
    block_m, block_n = validate_block_sizes(options["block_m"], options["block_n"])
    batch_index = check_index("batch_index", options["batch_index"], B, f"batch size B={B}")
    block_mask = one_head_block_mask(options["block_mask"], B)
    attn_mask, cu_seqlens, score_mod = options["attn_mask"], options["cu_seqlens"], options["score_mod"]
    causal_align, window, seqlens_k = options["causal_align"], options["window"], options["seqlens_k"]
    if cu_seqlens is not None and (score_mod is not None or block_mask is not None):
        raise AttentionValueError(
            "cu_seqlens cannot be combined with score_mod or block_mask (flash_attn_varlen_func takes no user "
            "functions): replay one sequence with its block mask, or the packed call without them"
        )
    if isinstance(attn_mask, Tensor) and attn_mask.dim() == 3:
        attn_mask = attn_mask.unsqueeze(-3)  # (B, N_q, N_k) -> (B, 1, N_q, N_k): the one head
    q4, k4, v4 = (one_head(t) if isinstance(t, Tensor) else t for t in (q, k, v))
    opts = make_options(
        q4,
        k4,
        v4,
        causal=options["causal"],
        causal_align=causal_align,
        scale=options["scale"],
        attn_mask=attn_mask,
        window=window,
        softcap=options["softcap"],
        alibi_slopes=one_slope(options["alibi_slopes"], B),
        seqlens_k=seqlens_k,
        score_mod=score_mod,
        block_mask=block_mask,
    )
    if cu_seqlens is not None:
        # The packed contract is built from the boundaries alone, as flash_attention_varlen's, which takes
        # neither a mask nor key lengths: refuse them rather than leave them out.
        for name, value in (("attn_mask", attn_mask), ("seqlens_k", seqlens_k)):
            if value is not None:
                raise AttentionValueError(
                    f"{name} is not used with cu_seqlens (each packed sequence's keys are its own); give one or the "
                    "other"
                )
        opts = _packed(opts, q, cu_seqlens, B, causal_align, window)
    dt = compute_dtype(q.dtype)
    sink = one_sink(options["sinks"], q.device, dt)  # (1,)
    q2, k2, v2 = (pick_matrix(t, name, batch_index).to(dt) for t, name in ((q, "query"), (k, "key"), (v, "value")))
    return OneHead(q2, k2, v2, opts, batch_index, block_m, block_n, sink)


def every_mask(mask: MaskSpec) -> dict[str, TileKind]:
    """The tile kinds that make ``MaskSpec.tensors`` build every mask of a region (the dense oracle's): the
    structure's, the ``attn_mask``'s, and the block mask's with ``mask_mod`` when the call has one."""
    user = TileKind.PARTIAL if mask.mods is not None and "mask_mod" in mask.mods.names else TileKind.FULL
    return {"structure": TileKind.PARTIAL, "mask": TileKind.PARTIAL, "user": user}


def rows_tensors(
    mask: MaskSpec, rows: tuple[int, int], N_k: int, device: torch.device, *, b: int
) -> tuple[Tensor | None, Tensor | None]:
    """``(visible, bias)``, each ``(Br, N_k)`` or None: every mask of the contract (:func:`every_mask`) on query
    rows ``[r0, r1)`` and every key, for batch element ``b`` and the one head, as the dense oracle sees them."""
    r0, r1 = rows
    return mask.tensors(r0, r1, 0, N_k, device, **every_mask(mask), b=b, h=0)


def rows_mask(mask: MaskSpec, rows: tuple[int, int], N_k: int, device: torch.device, *, b: int) -> Tensor | None:
    """The same rows' masks as dense attention's one ``attn_mask`` ``(Br, N_k)``: the bool ``visible`` when there
    is no bias, else the bias with ``-inf`` where a score is not visible."""
    visible, bias = rows_tensors(mask, rows, N_k, device, b=b)
    if bias is None:
        return visible
    return bias if visible is None else bias.masked_fill(~visible, float("-inf"))


def one_head_block_mask(block_mask: object, B: int) -> BlockMask | None:
    """``block_mask`` (this library's, or torch's ``create_block_mask``'s) for the one replayed head: its
    ``(B, H)`` must be ``(1 or B, 1)``. A mask built for several heads is refused rather than read at head 0:
    which head is replayed is the caller's choice, so the caller builds the mask for it (``H=None``)."""
    bm = check_block_mask(from_torch(block_mask))
    if bm is None:
        return None
    Bm, Hm = (*(1,) * (4 - len(bm.shape)), *bm.shape)[:2]
    if Hm != 1:
        raise AttentionValueError(
            f"block_mask was built for H = {Hm} heads, but the replay runs one head (its score_mod and mask_mod "
            "see h = 0): build it for the head to replay, create_block_mask(lambda b, _, q_idx, kv_idx: "
            f"mask_mod(b, head, q_idx, kv_idx), {Bm if Bm > 1 else None}, None, Q_LEN, KV_LEN, "
            "BLOCK_SIZE=(block_m, block_n)), and slice q, k, v to that head"
        )
    if Bm not in (1, B):
        raise AttentionValueError(
            f"block_mask was built for B = {Bm} batch elements, but q, k, v have B = {B}: build it with B=None "
            f"(one mask for every element) or B={B}"
        )
    return bm


# What a replay with cu_seqlens carries of the one head's mask contract into the packed one
# (dispatch/carry.py); _packed refuses anything else by name.
PACKED_MASK: Carries = {
    "shapes": always,
    "offset": always,  # unused when packed: each sequence has its own
    "causal": always,
    "left": always,  # the window, as given
    "right": always,
    "softcap": always,
    "alibi_slopes": always,  # per sequence
    "seqlens_k": unset("seqlens_k"),  # a packed sequence's keys are its own
    "attn_mask": unset("attn_mask"),
    "packed": unset("packed"),  # built here
    "per_element": lambda spec: not spec.per_element,
    "dtype": always,
    "mods": unset("mods"),  # flash_attn_varlen_func takes no user functions
    "_tilings": always,  # a cache
}


def _packed(
    opts: AttentionOptions, q: Tensor, cu_seqlens: Tensor, B: int, causal_align: str, window: tuple[int, int] | None
) -> AttentionOptions:
    """``opts`` with the packed sequences of ``cu_seqlens`` in the mask contract (the same boundaries for the
    queries and the keys, as in self-attention over a packed batch)."""
    s = opts.shapes
    if B != 1 or s.N_q != s.N_k:
        raise AttentionValueError(
            f"cu_seqlens packs sequences along one sequence axis: it needs B = 1 and N_q = N_k, got B={B}, "
            f"N_q={s.N_q}, N_k={s.N_k}"
        )
    cu = check_cu_seqlens("cu_seqlens", cu_seqlens, s.N_q, "N", q.device)
    dropped = uncarried(opts.mask, PACKED_MASK)
    if dropped:
        raise AttentionValueError(
            f"a replay with cu_seqlens does not carry the mask's {', '.join(dropped)}: replay without cu_seqlens"
        )
    mask = MaskSpec.build(
        s,
        q.dtype,
        causal=opts.causal,
        causal_align=causal_align,
        window=check_window(window),
        softcap=opts.mask.softcap,
        alibi_slopes=opts.mask.alibi_slopes,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
    )
    return replace(opts, mask=mask)
