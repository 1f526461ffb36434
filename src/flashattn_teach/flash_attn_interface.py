"""flash-attn 2's functions with flash-attn's layout, argument names, defaults and return values.

:func:`flashattn_teach.flash_attention` takes torch's layout, ``(B, H, N, D)``; flash-attn's functions take
``(B, N, H, D)`` (batch, seqlen, nheads, headdim), and a ``(B, N, H, D)`` tensor passed to the former is read
as N heads of H tokens: a result of the right shape and the wrong values. Code written for flash-attn imports
from here instead (``from flashattn_teach.flash_attn_interface import flash_attn_func``)::

    flash_attn_func(q, k, v, ...)               flash_attention(q.transpose(1, 2), ..., causal_align="bottom_right")
    flash_attn_kvpacked_func(q, kv, ...)        the same, k, v = kv.unbind(2)
    flash_attn_qkvpacked_func(qkv, ...)         the same, q, k, v = qkv.unbind(2)
    flash_attn_varlen_func(q, k, v, ...)        flash_attention_varlen (flash-attn's packed layout already)
    flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func    the same, unbound along dim 1
    flash_attn_with_kvcache(q, k_cache, ...)    flash_attention_with_kvcache on the caches' transposed views

The inputs are read through transposed views, never copied; the output is made contiguous in flash-attn's
layout (one copy of ``O``), as flash-attn returns it and as its callers' ``out.view(B, N, H * D)`` needs.

Arguments are flash-attn's, by position and keyword, with its defaults and meanings: ``causal`` and
``window_size`` align to the bottom-right corner (query i sees keys ``j <= i + N_k - N_q``), ``window_size``
``(-1, -1)`` (any negative side: unbounded; a pair of ints or a 2-element integer tensor), ``softcap <= 0``
no cap, ``alibi_slopes`` ``(H,)`` or ``(B, H)`` adding ``-slope * |i + N_k - N_q - j|``, grouped-query
attention by fewer key/value heads. ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)``:
``softmax_lse`` ``(B, H, N_q)`` (``(H, total_q)`` packed) in float32 (float64 for float64 inputs), and
``S_dmask``, with ``dropout_p > 0``, the weights and the dropout pattern as flash-attn's tests read them
(:mod:`flashattn_teach.reference.flash_attn_probs`), an empty tensor without dropout, as in flash-attn.

Where the values differ from flash-attn's, by design: a query row that sees no key has ``softmax_lse = -inf``
(the log of an empty sum, which :func:`flashattn_teach.merge_attention_states` reads; flash-attn's kernel
writes ``+inf`` there) and ``out = 0`` as in flash-attn; dropout draws from this library's counter-based
generator (:mod:`flashattn_teach.dropout`), so a seed gives another pattern than flash-attn's CUDA generator.

Beyond flash-attn: every backend (the CPU included), float32 and float64, any head dimension, a value head
dimension of its own, and gradients of ``q`` in ``flash_attn_with_kvcache``. Refused, by name with what to do:
what flash-attn refuses too (new keys without ``cache_seqlens``, ``cache_batch_idx`` with a paged cache, rotary
tables without new keys) and ``S_dmask`` with dropout inside ``torch.compile`` (the generator state it
replays is not read in a graph).
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from ._validate.inputs import check_bool
from .api import flash_attention_with_kvcache
from .api.flash_attn_layout import (
    FlashAttnOptions,
    Packing,
    attend,
    attend_varlen,
    cache_rows,
    check_rank,
    softcap_or_none,
    unpack,
    window_size_pair,
)
from .errors import AttentionValueError
from .reference.rotary import apply_rotary, check_rotary

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]

# flash-attn's module flag for its ROCm Triton backend, which its tests read; this module has none.
USE_TRITON_ROCM = False


def _get_block_size_n(device: object, head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """The key block ``S_dmask`` is written in, as flash-attn's test helpers ask: one block spanning every
    row, so each weight is relative to its row's maximum (:mod:`flashattn_teach.reference.flash_attn_probs`)."""
    return sys.maxsize


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """flash-attn's ``flash_attn_func``: ``q (B, N_q, H_q, D)``, ``k (B, N_k, H_kv, D)``, ``v (B, N_k, H_kv,
    D_v)`` -> ``out (B, N_q, H_q, D_v)``, or ``(out, softmax_lse (B, H_q, N_q), S_dmask)`` with
    ``return_attn_probs``. ``H_q`` a multiple of ``H_kv``: query head h reads key/value head
    ``h // (H_q // H_kv)``. The options are flash-attn's (the module's docstring); differentiable."""
    opts = FlashAttnOptions.of(locals())  # flash-attn's options, by its names
    return attend(q, k, v, opts)


def flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """flash-attn's ``flash_attn_kvpacked_func``: :func:`flash_attn_func` with ``kv (B, N_k, 2, H_kv, D)``
    holding the keys and values (read as views; gradients reach ``kv``)."""
    k, v = unpack("kv", kv, 2, 2, "(batch_size, seqlen_k, 2, nheads_k, headdim)")
    opts = FlashAttnOptions.of(locals())  # flash-attn's options, by its names
    return attend(q, k, v, opts)


def flash_attn_qkvpacked_func(
    qkv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """flash-attn's ``flash_attn_qkvpacked_func``: :func:`flash_attn_func` with ``qkv (B, N, 3, H, D)``
    holding the queries, keys and values (read as views; gradients reach ``qkv``)."""
    q, k, v = unpack("qkv", qkv, 2, 3, "(batch_size, seqlen, 3, nheads, headdim)")
    opts = FlashAttnOptions.of(locals())  # flash-attn's options, by its names
    return attend(q, k, v, opts)


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """flash-attn's ``flash_attn_varlen_func``: ``q (total_q, H_q, D)``, ``k, v (total_k, H_kv, D)``, sequence
    b at ``cu_seqlens[b]:cu_seqlens[b + 1]`` (int32 or int64 ``(B + 1,)``), each attending within itself, causal
    and windows aligned to its own bottom-right corner -> ``out (total_q, H_q, D_v)``, or ``(out, softmax_lse
    (H_q, total_q), S_dmask (B, H_q, max_seqlen_q, max_seqlen_k))``. With ``block_table (B, max_blocks)``,
    ``k, v`` are page pools ``(num_blocks, page_block_size, H_kv, D)`` (any page size). See
    :func:`flashattn_teach.flash_attention_varlen`."""
    opts = FlashAttnOptions.of(locals())  # flash-attn's options, by its names
    bounds = Packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return attend_varlen(q, k, v, bounds, opts, block_table)


def flash_attn_varlen_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: :func:`flash_attn_varlen_func` with
    ``kv (total_k, 2, H_kv, D)``."""
    k, v = unpack("kv", kv, 1, 2, "(total_k, 2, nheads_k, headdim)")
    opts = FlashAttnOptions.of(locals())  # flash-attn's options, by its names
    bounds = Packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return attend_varlen(q, k, v, bounds, opts, None)


def flash_attn_varlen_qkvpacked_func(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: :func:`flash_attn_varlen_func` with
    ``qkv (total, 3, H, D)`` and one ``cu_seqlens``, ``max_seqlen`` for queries and keys."""
    q, k, v = unpack("qkv", qkv, 1, 3, "(total, 3, nheads, headdim)")
    opts = FlashAttnOptions.of(locals())  # flash-attn's options, by its names
    bounds = Packing(cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    return attend_varlen(q, k, v, bounds, opts, None)


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    cache_seqlens: int | Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    block_table: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """flash-attn's ``flash_attn_with_kvcache``: append ``k, v (B, N_new, H_kv, D)`` to the caches in place at
    ``cache_seqlens[b]`` and attend ``q (B, N_q, H_q, D)`` over each element's keys -> ``out (B, N_q, H_q, D_v)``,
    and ``softmax_lse (B, H_q, N_q)`` with ``return_softmax_lse``.

    ``k_cache, v_cache``: ``(B_cache, seqlen_cache, H_kv, D)``, or with ``block_table (B, max_blocks)`` page pools
    ``(num_blocks, page_block_size, H_kv, D)`` (any page size), written through transposed views.
    ``cache_seqlens``: an int or ``(B,)``; None: every slot of the caches is valid (then no ``k, v``).
    ``cache_batch_idx (B,)``: element b's cache is row ``cache_batch_idx[b]`` of the caches (not with pages).
    ``cache_leftpad (B,)``: element b's keys start at that slot. ``rotary_cos, rotary_sin (seqlen_ro,
    rotary_dim / 2)`` rotate the new keys at positions ``cache_seqlens[b] + i`` and the queries there too when
    causal or windowed, else all at ``cache_seqlens[b]`` (:mod:`flashattn_teach.reference.rotary`;
    ``rotary_interleaved`` picks the pairs). Masks align bottom-right to each element's length. See
    :func:`flashattn_teach.flash_attention_with_kvcache` for the checks, the splits and the gradients."""
    layout = "(batch_size, seqlen, nheads, headdim)"
    check_rank("q", q, layout)
    pools = "(num_blocks, page_block_size, nheads_k, headdim)" if block_table is not None else layout
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_rank(name, t, pools)
    for name, new in (("k", k), ("v", v)):
        if new is not None:
            check_rank(name, new, layout)
    window = window_size_pair(window_size)
    B, N_q = q.shape[0], q.shape[1]
    if cache_seqlens is None:
        if k is not None:
            raise AttentionValueError(
                "k and v are appended at cache_seqlens, but cache_seqlens is None: pass cache_seqlens, the "
                "valid entries of each cache before this step"
            )
        capacity = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
        cache_seqlens = capacity  # flash-attn: every slot of the caches is valid
    starts = (
        torch.full((B,), cache_seqlens, dtype=torch.int64, device=q.device)
        if isinstance(cache_seqlens, int)
        else cache_seqlens
    )
    if rotary_cos is not None or rotary_sin is not None:
        if rotary_cos is None or rotary_sin is None or k is None:
            raise AttentionValueError(
                "rotary_cos and rotary_sin rotate the new keys k and the queries: pass both tables, and k and v"
            )
        check_rotary(rotary_cos, rotary_sin, q.shape[-1])
        first = starts.long()[:, None]  # (B, 1): where this step's tokens begin
        new_positions = first + torch.arange(k.shape[1], device=q.device)  # (B, N_new)
        k = apply_rotary(k, rotary_cos, rotary_sin, new_positions, interleaved=rotary_interleaved)
        # flash-attn: causal or windowed queries sit at the new tokens' positions; otherwise all at the first
        moving = causal or window != (-1, -1)
        q_positions = first + torch.arange(N_q, device=q.device) if moving else first.expand(B, N_q)
        q = apply_rotary(q, rotary_cos, rotary_sin, q_positions, interleaved=rotary_interleaved)
    rows = None
    caches = (k_cache, v_cache)
    if cache_batch_idx is not None:
        rows = cache_rows(cache_batch_idx, B, k_cache, block_table)
        caches = (k_cache.index_select(0, rows), v_cache.index_select(0, rows))  # element b's cache, copied
    out, lse = flash_attention_with_kvcache(
        q.transpose(1, 2),  # (B, N, H, D) -> (B, H, N, D), views
        caches[0].transpose(1, 2),
        caches[1].transpose(1, 2),
        None if k is None else k.transpose(1, 2),
        None if v is None else v.transpose(1, 2),
        cache_seqlens=cache_seqlens,
        block_table=block_table,
        cache_leftpad=cache_leftpad,
        causal=causal,
        scale=softmax_scale,
        window=window,
        softcap=softcap_or_none(softcap),
        alibi_slopes=alibi_slopes,
        num_splits=num_splits,
        return_lse=True,
    )
    if rows is not None and k is not None:
        # the new entries, written into the copies after every check, go back to the caches' own rows
        slots = starts.long()[:, None] + torch.arange(k.shape[1], device=q.device)  # (B, N_new)
        element = torch.arange(B, device=q.device)[:, None]
        for cache, copy in zip((k_cache, v_cache), caches, strict=True):
            cache[rows[:, None], slots] = copy[element, slots]
    out = out.transpose(1, 2).contiguous()  # (B, H_q, N_q, D_v) -> (B, N_q, H_q, D_v)
    return (out, lse) if check_bool("return_softmax_lse", return_softmax_lse) else out
