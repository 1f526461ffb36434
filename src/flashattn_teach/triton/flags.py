"""The kernels' variant flags as one record: :class:`Flags`, built once by :func:`kernel_flags` and passed whole
as the one ``F: tl.constexpr`` of the forward and backward kernels and of their key and query loops, whose
bodies read ``F.CAUSAL``, ``F.SCORE_MOD``, ``F.BLOCK_D2`` ...

    CAUSAL      causal, not folded into a window            WINDOW      a sliding window (LEFT, RIGHT)
    SOFTCAP     softcap on the scaled scores                ALIBI       ALiBi slopes
    SEQLENS     seqlens_k, a key length per batch element   DROPOUT     dropout (p > 0)
    BOOL_MASK   a bool attn_mask (uint8 in the kernels)     ADD_MASK    an additive attn_mask
    VARLEN      packed sequences                            DOT_PRECISION  the dots' input precision
    TMA         K, V (forward) or Q, dO (dK/dV) or K, V (dQ) by host tensor descriptors
    GRID_ORDER  the causal grid's order (:mod:`.kernels.grid`)
    SCORE_MOD, MASK_MOD   the user's functions compiled to ``@triton.jit`` (:mod:`.usermod`), or None
    KINDS       a block mask's tile kinds                   LISTED      the loop over its tile list
    BLOCK_D2    the head dim's second lane group (0: one group, :mod:`.kernels.tiles`)
    TRACE       the trace build (issue 39)

A ``tl.constexpr`` NamedTuple is a compile-time constant as a whole: ``if F.CAUSAL:`` is a static branch, a
field may hold a ``@triton.jit`` function or an int, a helper called with ``F`` is specialised on it, and
the JIT's cache key holds the record's values, so two records that differ in one flag compile two kernels
(checked with triton 3.6 and 3.9, interpreter and sm_90 compiles, before the kernels took it). The flags a
single kernel alone takes stay parameters of their own (the forward's ``NEGATE_Q, WS, EVEN_N, FP8, SINKS``,
the backward's ``SCORE_GRAD``, the dK/dV kernel's ``WITH_DK, WITH_DV, DQ_ATOMIC``), as do the tile sizes.
The capture tools name each field by its bare name (:meth:`flashattn_teach.tools.kernels.specialize.
CompileRequest.constants`), so a specialisation keeps the name it had when the flags were parameters.

``repr`` names a ``@triton.jit`` field by its source hash: triton's on-disk cache keys a constexpr that is not
itself a function by its ``str``, which for a function would be its module and name only.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..masks.grid import LONGEST, PER_HEAD
from .configs import AttentionConfig
from .variants import KernelVariants


class Flags(NamedTuple):
    """The variant flags every attention kernel takes (see the module's table)."""

    CAUSAL: bool
    WINDOW: bool
    SOFTCAP: bool
    ALIBI: bool
    SEQLENS: bool
    DROPOUT: bool
    BOOL_MASK: bool
    ADD_MASK: bool
    VARLEN: bool
    DOT_PRECISION: str
    TMA: bool
    GRID_ORDER: int
    SCORE_MOD: Any
    MASK_MOD: Any
    KINDS: bool
    LISTED: bool
    BLOCK_D2: int
    TRACE: bool

    def __repr__(self) -> str:
        shown = (f"{k}={getattr(v, 'cache_key', None) or v!r}" for k, v in zip(self._fields, self, strict=True))
        return f"Flags({', '.join(shown)})"


def grid_order(config: AttentionConfig) -> int:
    """The kernels' ``GRID_ORDER`` under causal (:mod:`.kernels.grid`): all heads' longest blocks first where
    ``config.longest_first``, else each head's blocks longest first (the order that ran on a GPU)."""
    return LONGEST if config.longest_first else PER_HEAD


def kernel_flags(
    variants: KernelVariants, *, causal: bool, config: AttentionConfig, block_d2: int, precision: str, trace: bool
) -> Flags:
    """A call's :class:`Flags`, as the forward and both backward kernels take them. A window carries causal in
    its right side (``CAUSAL`` then False). ``TMA`` False and ``LISTED`` with a block mask: each launch
    replaces them with its own tile's (``flags._replace(TMA=tma)``)."""
    return Flags(
        CAUSAL=causal and not variants.window,
        WINDOW=variants.window,
        SOFTCAP=variants.has_softcap,
        ALIBI=variants.has_alibi,
        SEQLENS=variants.has_seqlens,
        DROPOUT=variants.has_dropout,
        BOOL_MASK=variants.bool_mask,
        ADD_MASK=variants.additive_mask,
        VARLEN=variants.varlen,
        DOT_PRECISION=precision,
        TMA=False,
        GRID_ORDER=grid_order(config),
        SCORE_MOD=variants.score_mod_fn,
        MASK_MOD=variants.mask_mod_fn,
        KINDS=variants.has_kinds,
        LISTED=variants.has_kinds,
        BLOCK_D2=block_d2,
        TRACE=trace,
    )
