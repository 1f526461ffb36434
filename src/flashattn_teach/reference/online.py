"""Public entry points of the tiled CPU references: ``online_attention`` and ``key_major_attention``."""

from __future__ import annotations

import warnings
from typing import Any, Literal, overload

from torch import Tensor

from .._autocast import cast_inputs
from .._options import AttentionOptions, make_options
from .._validate.inputs import check_bool, validate_block_sizes
from ..flex.mods import BlockMask, MaskMod, ScoreMod
from .autograd import TileLoop, attend
from .defaults import DEFAULT_BLOCK_M, DEFAULT_BLOCK_N


def tiled_attention(
    q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, *, order: str, block_m: int, block_n: int
) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of validated inputs by one of the tiled loops (``order`` in ``autograd.ORDERS``):
    :func:`~.autograd.attend` with ``TileLoop(order, block_m, block_n)``."""
    return attend(q, k, v, opts, TileLoop(order, block_m, block_n))


def _public(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    order: str,
    causal: bool,
    causal_align: str,
    scale: float | None,
    enable_gqa: bool,
    window: tuple[int, int] | None,
    softcap: float | None,
    alibi_slopes: Tensor | None,
    seqlens_k: Tensor | None,
    attn_mask: Tensor | None,
    dropout_p: float,
    score_mod: ScoreMod | None,
    mask_mod: MaskMod | None,
    block_mask: BlockMask | None,
    sinks: Tensor | None,
    block_m: int,
    block_n: int,
    return_lse: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    q, k, v = cast_inputs(q, k, v)
    opts = make_options(
        q,
        k,
        v,
        causal=causal,
        causal_align=causal_align,
        scale=scale,
        enable_gqa=enable_gqa,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        seqlens_k=seqlens_k,
        score_mod=score_mod,
        mask_mod=mask_mod,
        block_mask=block_mask,
        sinks=sinks,
    )
    block_m, block_n = validate_block_sizes(block_m, block_n)
    O, lse = tiled_attention(q, k, v, opts.with_dropout(), order=order, block_m=block_m, block_n=block_n)
    return (O, lse) if check_bool("return_lse", return_lse) else O


@overload
def online_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    enable_gqa: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    seqlens_k: Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
    sinks: Tensor | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
    return_lse: Literal[False] = False,
) -> Tensor: ...


@overload
def online_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    enable_gqa: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    seqlens_k: Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
    sinks: Tensor | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
    return_lse: Literal[True],
) -> tuple[Tensor, Tensor]: ...


@overload
def online_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    enable_gqa: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    seqlens_k: Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
    sinks: Tensor | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]: ...


def online_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    enable_gqa: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    seqlens_k: Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
    sinks: Tensor | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
    return_lse: bool = False,
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
    return _public(
        q,
        k,
        v,
        order="query_major",
        causal=causal,
        causal_align=causal_align,
        scale=scale,
        enable_gqa=enable_gqa,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        seqlens_k=seqlens_k,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        score_mod=score_mod,
        mask_mod=mask_mod,
        block_mask=block_mask,
        sinks=sinks,
        block_m=block_m,
        block_n=block_n,
        return_lse=return_lse,
    )


@overload
def key_major_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    enable_gqa: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    seqlens_k: Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
    sinks: Tensor | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
    return_lse: Literal[False] = False,
) -> Tensor: ...


@overload
def key_major_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    enable_gqa: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    seqlens_k: Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
    sinks: Tensor | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
    return_lse: Literal[True],
) -> tuple[Tensor, Tensor]: ...


@overload
def key_major_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    enable_gqa: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    seqlens_k: Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
    sinks: Tensor | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]: ...


def key_major_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    enable_gqa: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    seqlens_k: Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
    sinks: Tensor | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention in FlashAttention's Algorithm 1 order (key blocks outside, query blocks inside).

    Same arguments, results and backward as :func:`online_attention`; only the loop order and the
    per-tile read/write of ``O_i, l_i, m_i`` differ.
    """
    return _public(
        q,
        k,
        v,
        order="key_major",
        causal=causal,
        causal_align=causal_align,
        scale=scale,
        enable_gqa=enable_gqa,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        seqlens_k=seqlens_k,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        score_mod=score_mod,
        mask_mod=mask_mod,
        block_mask=block_mask,
        sinks=sinks,
        block_m=block_m,
        block_n=block_n,
        return_lse=return_lse,
    )


def keymajor_attention(*args: Any, **kwargs: Any) -> Any:
    """Deprecated name of :func:`key_major_attention` (the library spells the loop orders ``query_major``
    and ``key_major``); it will be removed in 0.3."""
    warnings.warn("keymajor_attention is deprecated; use key_major_attention", DeprecationWarning, stacklevel=2)
    return key_major_attention(*args, **kwargs)
