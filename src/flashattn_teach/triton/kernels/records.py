"""The kernels' arguments as named records, built by name on the host and read by name in the kernels (as
FlashAttention's CuTe code passes its ``kernel_args``): a tensor and its strides are one :class:`Strided`,
and each variant of the mask contract one record, or None where the call does not use it.

    Strided        a (B, H, N, X) tensor (or a tensor descriptor) and its four strides
    ForwardTensors a kernel's Strided tensors by name (DkdvTensors, DqTensors, DecodeTensors), passed
                   as two records by split: every pointer, then every stride
    Lse            lse's pointer and its head stride (``N_q``, or ``total_q`` with packed sequences)
    RowStats       the backward's lse2 and delta, laid out as lse, and their head stride
    Bounds         where each row's keys stop: OFFSET, the window's LEFT and RIGHT, SEQLENS_K (or None)
    ScoreTerms     what changes a score: softcap (in log2 units), ALiBi slopes, the user's attn_mask
    Dropout        the key of :class:`flashattn_teach.dropout.DropoutKey` as the kernels draw it
    Packed         packed sequences' ``cu_seqlens_q, cu_seqlens_k (B + 1,)`` int32
    UserMods       score_mod's and mask_mod's captured tensors, the block mask's tile kinds and tile list
    Descales       an FP8 call's Q, K, V descales (B, H_kv) fp32 and their strides
    Partials       the decode kernel's split outputs (num_splits, B, H_q, N_new, X) and their strides
    Pages          a paged cache's block table and page sizes (the decode kernel)
    CacheLengths   a decode step's lengths: the cache's, its left padding, the new rows'

The records are :class:`typing.NamedTuple`: ``@triton.jit`` takes them as kernel arguments and as
arguments of the helpers a kernel calls, and specialises each field as it would a plain argument (an
integer equal to 1 becomes a constant, one divisible by 16 gets the divisibility attribute, None becomes a
``constexpr`` None), so a record changes no specialisation and no Triton IR (the TTGIR of a masked dK/dV
and of a forward matched the positional kernels' line for line). A field that is None is never read: the
kernel reaches it only under the ``tl.constexpr`` flag of its variant (no placeholder pointer stands in for an
unused tensor).

The parameters' order is not free. Triton lays a record's fields out in place, and ptxas's schedule moves with
which 32-bit parameters share an aligned 8-byte word of the constant bank: with each tensor's pointer among
its own strides, some loops were a few instructions longer or shorter than the positional kernels' and some
spilled 8 to 24 bytes more. So a kernel takes its tensors as two records made by :func:`split`, every pointer
(``ptr``) ahead of every stride (``stride``), the positional kernels' layout, and makes its :class:`Strided`
records again in its first lines (``benchmarks/results/kernel_args/README.md``, rounds 3 and 4).

The records are flat, but for a kernel's ``stride`` record of :class:`Strides` and the captures' tuple. Inside
a record every integer equal to 1 becomes a constant, ``do_not_specialize`` or not, and triton 3.6 loses
such a constant one level down: its ``ASTFunction.deserialize`` sets a record's runtime fields first and its
constants after, and each ``tuple._setitem`` rebuilds only that tuple's type, so an outer record whose own
None field (an unused ALiBi) is set after its inner record's values but before the inner constant keeps the
inner field typed ``constexpr[None]``; every ``if`` or ``for`` region then clones the record from that type
(``enter_sub_region``), and a mask's key stride of 1 reached ``_attn_mask_tile`` as None. Triton 3.9 sets
each field in one pass and is not affected. ``ScoreTerms`` and ``UserMods`` therefore carry each table and
its strides as fields of their own (``mask``, ``mask_stride_m``, ...); a ``stride`` record has no None field of
its own (an absent dQ buffer is a :class:`Strides` of None), and the tests check every unit stride arrives as the
constant 1 (tests/triton/test_triton_loops.py).

Which triton takes them (checked before this module was written, 2026-12-06, on a machine without a GPU):
triton 3.4.0, 3.6.0 and 3.9.0 accept NamedTuples as ``@triton.jit`` kernel parameters and as parameters of
``@triton.jit`` helpers, None fields and tensor descriptors in a field, both in the
interpreter (``TRITON_INTERPRET=1``) and in ahead-of-time compiles (the capture of
:mod:`flashattn_teach.tools.kernels.specialize`, whose compile request then holds a nested ``signature``
and ``constexprs`` keyed by paths such as ``(0, 4)``); triton 3.4's launcher flattens tuple arguments
(``make_launcher``'s ``_flatten_signature``), and triton 3.4 compiled these kernels for sm_90 (the forward
and both backwards, plain and with every variant and dropout). A plain tuple is refused by name (``t.ptr``
of a tuple), so every record is named. The floor stays triton 3.4. No GPU launched a record yet.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, TypeVar

from torch import Tensor

LOG2E = 1 / math.log(2)  # exp(x) = exp2(x * LOG2E); kernels.masking.LOG2E is the kernels' copy, behind a triton import


class Strided(NamedTuple):
    """A ``(B, H, N, X)`` tensor, or a tensor descriptor of one, and its strides in elements (torch's order). The
    forward, dK/dV, dQ and decode kernels take their tensors as :func:`split` records and make each one of these
    again in their first lines; the backward's preprocess kernel takes ``O, DO`` as they are."""

    ptr: Any
    stride_b: int
    stride_h: int
    stride_n: int
    stride_d: int

    def strides(self) -> Strides:
        return Strides(*self[1:])


class Strides(NamedTuple):
    """A :class:`Strided`'s strides alone (None each where the call has no such tensor)."""

    stride_b: int | None
    stride_h: int | None
    stride_n: int | None
    stride_d: int | None


def strided(t: Any, strides: tuple[int, ...] | None = None, *, varlen: bool = False) -> Strided:
    """``t`` (B, H, N, X) with its strides (or ``strides``, those of the tensor a descriptor ``t`` reads). With
    packed sequences (``varlen``, a ``(1, H, total, X)`` view) the grid's batch index is the sequence, whose
    start row moves the base pointer instead: the batch stride is passed as 0."""
    b, h, n, x = t.stride() if strides is None else strides
    return Strided(t, stride_b=0 if varlen else b, stride_h=h, stride_n=n, stride_d=x)


class ForwardTensors(NamedTuple):
    """``attn_fwd``'s tensors, each a :class:`Strided` (the pointers or the strides once :func:`split`)."""

    Q: Any
    K: Any
    V: Any
    O: Any


class DkdvTensors(NamedTuple):
    """``attn_bwd_dkdv``'s tensors; ``DQ`` (the one-kernel backward's dQ buffer) None in the two-kernel one."""

    Q: Any
    K: Any
    V: Any
    DO: Any
    DK: Any
    DV: Any
    DQ: Any


class DqTensors(NamedTuple):
    """``attn_bwd_dq``'s tensors."""

    Q: Any
    K: Any
    V: Any
    DO: Any
    DQ: Any


class DecodeTensors(NamedTuple):
    """``decode_split_fwd``'s tensors: ``Q, K, V`` :class:`Strided`, ``O, LSE`` :class:`Partials`."""

    Q: Any
    K: Any
    V: Any
    O: Any
    LSE: Any


T = TypeVar("T", ForwardTensors, DkdvTensors, DqTensors, DecodeTensors)


def split(tensors: T) -> tuple[T, T]:
    """A kernel's tensors (a record above of :class:`Strided` or :class:`Partials`, a field None where the call
    has no such tensor) as two records of the same class: the pointers, then the strides (a :class:`Strides` or
    :class:`PartialStrides` each).
    The kernel takes the two first, as ``ptr`` and ``stride``, and makes its records again (``Q =
    Strided(ptr.Q, *stride.Q)``).

    Why not the records themselves: Triton lays a kernel's parameters out in the order it takes them, a record's
    fields in place, and ptxas's schedule depends on which parameters share an aligned 8-byte word of the
    constant bank. With every pointer ahead of every stride, the layout of the positional kernels, 454 of 465
    specialisations compile as theirs did with triton 3.6 and 444 with 3.9, 3 loops are 1-2 instructions longer
    and none spills more; with each pointer among its own strides 18 loops were up to 12 instructions longer and
    4 rows spilled 8-24 bytes more (``benchmarks/results/kernel_args/README.md``, rounds 2 and 4)."""
    cls = type(tensors)
    pointers = cls(*(None if t is None else t.ptr for t in tensors))
    # a tensor the call lacks (only DkdvTensors.DQ can) has None for its pointer and each stride: constants all
    strides = cls(*(Strides(None, None, None, None) if t is None else t.strides() for t in tensors))
    return pointers, strides


class Partials(NamedTuple):
    """The decode kernel's split outputs ``(num_splits, B, H_q, N_new, X)`` and their strides (lse as
    ``(num_splits, B, H_q, N_new, 1)``)."""

    ptr: Any
    stride_s: int
    stride_b: int
    stride_h: int
    stride_n: int
    stride_d: int

    def strides(self) -> PartialStrides:
        return PartialStrides(*self[1:])


class PartialStrides(NamedTuple):
    """A :class:`Partials`' strides alone."""

    stride_s: int
    stride_b: int
    stride_h: int
    stride_n: int
    stride_d: int


class Lse(NamedTuple):
    """``lse (B, H_q, N_q)`` fp32, contiguous, or ``(H_q, total_q)`` with packed sequences: ``stride_h``."""

    ptr: Any
    stride_h: int


class RowStats(NamedTuple):
    """The backward's row statistics ``lse2 = lse * log2(e)`` and ``delta = rowsum(dO * O)``, each laid out as
    :class:`Lse` (``(B, H_q, N_q)`` contiguous fp32, or ``(H_q, total_q)``), with their head stride. ``trace``
    rides here so that the trace build adds no kernel argument (the dK/dV kernel takes the most, 20)."""

    lse2: Tensor
    delta: Tensor
    stride_h: int
    trace: Tensor | None = None  # the backward's trace build (kernels.trace_backward): its buffer; None, a constant


class Bounds(NamedTuple):
    """Where each query row's keys stop: row i sees key j iff ``i + OFFSET - LEFT <= j <= i + OFFSET + RIGHT``
    (:mod:`.kernels.masking`; LEFT, RIGHT are :data:`flashattn_teach.triton.variants.UNBOUNDED` without a
    window) and ``j < SEQLENS_K[b]`` (int32 ``(B,)``, or None)."""

    OFFSET: int
    LEFT: int
    RIGHT: int
    SEQLENS_K: Tensor | None


class ScoreTerms(NamedTuple):
    """What changes a score: ``softcap_log2 = softcap * log2(e)`` (1.0 without); ALiBi's slopes ``(1 or B,
    H_q)`` fp32 (or ``(H_q,)``), read at ``b * alibi_stride_b + h * alibi_stride_h``; the user's ``attn_mask
    (B, H_q, N_q, N_k)`` (uint8 for a bool mask, else additive in its dtype), read at ``b * mask_stride_b +
    h * mask_stride_h + i * mask_stride_m + j * mask_stride_n`` (strides 0 along broadcast dims). A table
    and its strides are None together when unset. Flat, not a record of records: see the module's note."""

    softcap_log2: float
    alibi: Tensor | None
    alibi_stride_b: int | None
    alibi_stride_h: int | None
    mask: Tensor | None
    mask_stride_b: int | None
    mask_stride_h: int | None
    mask_stride_m: int | None
    mask_stride_n: int | None


def score_terms(softcap: float | None, slopes: Tensor | None, attn_mask: Tensor | None) -> ScoreTerms:
    """:class:`ScoreTerms` of a call: ``slopes`` ``(H_q,)`` or ``(1 or B, H_q)`` (batch stride 0 where one row
    serves every batch element), ``attn_mask`` at its own strides, each None when unset."""
    alibi: tuple[Tensor | None, int | None, int | None] = (None, None, None)
    if slopes is not None:
        one_row = slopes.dim() == 1 or slopes.shape[0] == 1
        alibi = (slopes, 0 if one_row else slopes.stride(0), slopes.stride(-1))
    mask: tuple[int | None, ...] = (None,) * 4 if attn_mask is None else tuple(attn_mask.stride())
    return ScoreTerms(1.0 if softcap is None else softcap * LOG2E, *alibi, attn_mask, *mask)


class Dropout(NamedTuple):
    """The draw of :mod:`flashattn_teach.dropout`: ``seed``, the counters' ``offset``, ``threshold = round(p
    2^31)`` and ``keep_scale = 1 / (1 - p)``."""

    seed: int
    offset: int
    threshold: int
    keep_scale: float


class Packed(NamedTuple):
    """Packed sequences: ``cu_seqlens_q, cu_seqlens_k (B + 1,)`` int32."""

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor


class UserMods(NamedTuple):
    """FlexAttention's functions' data: the captured tensors of score_mod and of mask_mod (four each, None in
    the unused ones); a block mask's tile ``kinds`` at the launch's tiles, int8 ``(B|1, H|1, T_r, T_c)``
    read at ``b * kinds_stride_b + h * kinds_stride_h + r * kinds_stride_m + c * kinds_stride_n``; with
    ``LISTED`` each tile's ``tiles`` to visit (:func:`flashattn_teach.triton.variants.tile_list`), int32
    ``(B|1, H|1, T, 1 + T')`` read at ``b * tiles_stride_b + h * tiles_stride_h + r * tiles_stride_m``
    (strides 0 along broadcast dims). A table and its strides are None together when unset."""

    score_captures: tuple[Tensor | None, ...]
    mask_captures: tuple[Tensor | None, ...]
    kinds: Tensor | None
    kinds_stride_b: int | None
    kinds_stride_h: int | None
    kinds_stride_m: int | None
    kinds_stride_n: int | None
    tiles: Tensor | None
    tiles_stride_b: int | None
    tiles_stride_h: int | None
    tiles_stride_m: int | None


class Descales(NamedTuple):
    """An FP8 call's descales ``q, k, v (B, H_kv)`` fp32, contiguous, read at ``b * stride_b + h_kv * stride_h``."""

    q: Tensor
    k: Tensor
    v: Tensor
    stride_b: int
    stride_h: int


class Pages(NamedTuple):
    """A paged cache (flash-attn's ``block_table``): batch element b's pages at ``table + b * stride_b + n *
    stride_n`` (int32), ``PAGE_SIZE`` keys a page, ``num_blocks`` pages in the cache."""

    table: Tensor
    stride_b: int
    stride_n: int
    PAGE_SIZE: int
    num_blocks: int


class CacheLengths(NamedTuple):
    """A decode step's lengths: ``cache_seqlens (B,)`` int32 before the step's ``N_new_kv`` appended rows,
    ``cache_leftpad (B,)`` int32 (or None), ``N_new`` new queries, ``N_max`` rows the cache holds."""

    cache_seqlens: Tensor
    cache_leftpad: Tensor | None
    N_new: int
    N_new_kv: int
    N_max: int
