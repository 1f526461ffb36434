"""Public entry points of the tiled CPU references: ``online_attention`` and ``key_major_attention``."""

from __future__ import annotations

import warnings
from typing import Annotated, Any, Literal, overload

from torch import Tensor
from typing_extensions import Unpack

from .._autocast import cast_inputs
from .._options import AttentionKeywords, AttentionOptions, make_options
from .._validate.inputs import check_bool, validate_block_sizes
from .._validate.keywords import Default, collects_keywords
from .autograd import TileLoop, attend
from .defaults import DEFAULT_BLOCK_M, DEFAULT_BLOCK_N


def tiled_attention(
    q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, *, order: str, block_m: int, block_n: int
) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of validated inputs by one of the tiled loops (``order`` in ``autograd.ORDERS``):
    :func:`~.autograd.attend` with ``TileLoop(order, block_m, block_n)``."""
    return attend(q, k, v, opts, TileLoop(order, block_m, block_n))


class TiledKeywords(AttentionKeywords, total=False):
    """The tiled references' keywords: the shared ones (:class:`flashattn_teach._options.AttentionKeywords`)
    and the tile sizes."""

    block_m: Annotated[int, Default(DEFAULT_BLOCK_M)]  # Br, query rows per tile
    block_n: Annotated[int, Default(DEFAULT_BLOCK_N)]  # Bc, keys per tile


def _public(q: Tensor, k: Tensor, v: Tensor, options: TiledKeywords, *, order: str) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of a public call of the loop ``order``: its keywords checked once, its dropout key drawn."""
    q, k, v = cast_inputs(q, k, v)
    opts = make_options(q, k, v, options)
    block_m, block_n = validate_block_sizes(options["block_m"], options["block_n"])
    return tiled_attention(q, k, v, opts.with_dropout(), order=order, block_m=block_m, block_n=block_n)


# The one pair of signatures kept written out: return_lse decides the result's type, which mypy reads from them.
@overload
def online_attention(
    q: Tensor, k: Tensor, v: Tensor, *, return_lse: Literal[False] = False, **options: Unpack[TiledKeywords]
) -> Tensor: ...
@overload
def online_attention(
    q: Tensor, k: Tensor, v: Tensor, *, return_lse: Literal[True], **options: Unpack[TiledKeywords]
) -> tuple[Tensor, Tensor]: ...


@collects_keywords()
def online_attention(
    q: Tensor, k: Tensor, v: Tensor, *, options: TiledKeywords, return_lse: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention by query-major online softmax (the teaching example; FlashAttention-2's order).

    Args:
        q: ``(..., H_q, N_q, D)``; k: ``(..., H_kv, N_k, D)``; v: ``(..., H_kv, N_k, D_v)``, broadcasting
            as in torch's ``scaled_dot_product_attention``.
        causal, causal_align: see :mod:`flashattn_teach.masks.causal`; key blocks wholly above the diagonal are
            skipped, not computed.
        scale: softmax scale, default ``1 / sqrt(D)``.
        enable_gqa: allow ``H_kv`` to divide ``H_q``.
        window, softcap, alibi_slopes, seqlens_k, attn_mask: the mask contract of
            :mod:`flashattn_teach.masks` (as :func:`flashattn_teach.reference.dense_attention`); tiles no
            row sees are never visited, wholly visible ones run without a mask. No gradient flows to
            ``alibi_slopes`` or ``attn_mask``.
        dropout_p: dropout on the attention weights, as :func:`flashattn_teach.reference.dense_attention`
            (the same mask for the same key; drawn tile by tile, and again in the backward, never stored).
        score_mod, mask_mod, block_mask: FlexAttention's user functions, as
            :func:`flashattn_teach.flash_attention` takes them, run on each tile's index tensors.
        sinks: attention sinks ``(H_q,)``, as :func:`flashattn_teach.flash_attention` takes them: each row's
            state starts at its head's sink (``m = sink_h``, ``l = 1``), so ``lse`` includes it.
        deterministic: taken as :func:`flashattn_teach.flash_attention` takes it; this path always is.
        block_m, block_n: query and key tile sizes (``Br``, ``Bc`` in the papers); any sizes >= 1, they
            need not divide N.
        return_lse: also return ``lse = m + log l`` of shape ``(..., H_q, N_q)``.

    Returns:
        ``O`` of shape ``(..., H_q, N_q, D_v)`` in ``q``'s dtype (computed in float64 for float64 inputs,
        else float32; under ``torch.autocast`` the inputs are first cast to the autocast dtype, as torch's
        SDPA does), and ``lse`` in the compute dtype if asked. Differentiable, also under the torch.func
        transforms: the backward is :func:`flashattn_teach.reference.flash_backward`, and only
        ``q, k, v, O, lse`` are saved.
    """
    O, lse = _public(q, k, v, options, order="query_major")
    return (O, lse) if check_bool("return_lse", return_lse) else O


@overload
def key_major_attention(
    q: Tensor, k: Tensor, v: Tensor, *, return_lse: Literal[False] = False, **options: Unpack[TiledKeywords]
) -> Tensor: ...
@overload
def key_major_attention(
    q: Tensor, k: Tensor, v: Tensor, *, return_lse: Literal[True], **options: Unpack[TiledKeywords]
) -> tuple[Tensor, Tensor]: ...


@collects_keywords()
def key_major_attention(
    q: Tensor, k: Tensor, v: Tensor, *, options: TiledKeywords, return_lse: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention in FlashAttention's Algorithm 1 order (key blocks outside, query blocks inside).

    Same arguments, results and backward as :func:`online_attention`; only the loop order and the
    per-tile read/write of ``O_i, l_i, m_i`` differ.
    """
    O, lse = _public(q, k, v, options, order="key_major")
    return (O, lse) if check_bool("return_lse", return_lse) else O


def keymajor_attention(*args: Any, **kwargs: Any) -> Any:
    """Deprecated name of :func:`key_major_attention` (the library spells the loop orders ``query_major``
    and ``key_major``); it will be removed in 0.3."""
    warnings.warn("keymajor_attention is deprecated; use key_major_attention", DeprecationWarning, stacklevel=2)
    return key_major_attention(*args, **kwargs)
