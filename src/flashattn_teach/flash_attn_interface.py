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
(:mod:`flashattn_teach.integrations.flash_attn_probs`), an empty tensor without dropout, as in flash-attn.

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

import numbers
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from ._validate.inputs import check_bool, real_number, shape_str, values_on_host
from .api import flash_attention, flash_attention_varlen, flash_attention_with_kvcache
from .api.varlen_pages import gather_paged_keys
from .dropout import DropoutKey
from .errors import AttentionTypeError, AttentionValueError
from .integrations.flash_attn_probs import replayed_key, signed_weights
from .integrations.rotary import apply_rotary, check_rotary

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
    row, so each weight is relative to its row's maximum (:mod:`flashattn_teach.integrations.flash_attn_probs`)."""
    return sys.maxsize


@dataclass(frozen=True)
class _Options:
    """The options every flash-attn function shares, checked once and in this library's terms."""

    dropout_p: float
    scale: float | None
    causal: bool
    window: tuple[int, int]
    softcap: float | None
    alibi_slopes: Tensor | None
    deterministic: bool
    return_attn_probs: bool

    @classmethod
    def of(
        cls,
        *,
        dropout_p: float,
        softmax_scale: float | None,
        causal: bool,
        window_size: object,
        softcap: float,
        alibi_slopes: Tensor | None,
        deterministic: bool,
        return_attn_probs: bool,
    ) -> _Options:
        probs = check_bool("return_attn_probs", return_attn_probs)
        p = real_number("dropout_p", dropout_p)
        if probs and p > 0.0 and torch.compiler.is_compiling():
            raise AttentionValueError(
                "return_attn_probs=True with dropout_p > 0 under torch.compile: S_dmask replays the generator "
                "state before the call, which a graph does not read; call it eagerly, or pass "
                "return_attn_probs=False"
            )
        return cls(
            dropout_p=p,
            scale=softmax_scale,
            causal=check_bool("causal", causal),
            window=_window(window_size),
            softcap=_softcap(softcap),
            alibi_slopes=alibi_slopes,
            deterministic=check_bool("deterministic", deterministic),
            return_attn_probs=probs,
        )

    @property
    def wants_weights(self) -> bool:
        """Whether ``S_dmask`` holds anything: flash-attn writes it only with dropout."""
        return self.return_attn_probs and self.dropout_p > 0.0


def _window(window_size: object) -> tuple[int, int]:
    """flash-attn's ``window_size``: two ints (a list, a tuple or an integer tensor), any negative side -1."""
    sides = window_size.tolist() if isinstance(window_size, Tensor) else window_size
    if not isinstance(sides, (tuple, list)) or len(sides) != 2:
        raise AttentionTypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    for w in sides:
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise AttentionTypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    return max(int(sides[0]), -1), max(int(sides[1]), -1)


def _softcap(softcap: object) -> float | None:
    """flash-attn's ``softcap``: a cap when above 0, none otherwise."""
    value = real_number("softcap", softcap)
    return value if value > 0.0 else None


def _check_rank(name: str, t: object, layout: str) -> Tensor:
    """``t``, a tensor with as many dimensions as flash-attn's ``layout`` names."""
    rank = len(layout.split(","))
    if not isinstance(t, Tensor) or t.dim() != rank:
        got = shape_str(t) if isinstance(t, Tensor) else type(t).__name__
        raise AttentionValueError(
            f"{name} must be {layout} (flash-attn's layout), got {got}; for torch's (B, H, N, D) layout "
            "call flashattn_teach.flash_attention"
        )
    return t


def _unpack(name: str, packed: Tensor, dim: int, count: int, layout: str) -> tuple[Tensor, ...]:
    """``packed`` unbound along ``dim`` into its ``count`` views (q, k, v or k, v)."""
    _check_rank(name, packed, layout)
    if packed.shape[dim] != count:
        raise AttentionValueError(f"{name} must be {layout}, got {shape_str(packed)}")
    return packed.unbind(dim)


def _no_weights(q: Tensor) -> Tensor:
    """flash-attn's ``S_dmask`` of a call without dropout: an empty tensor."""
    return torch.empty(0, dtype=q.dtype, device=q.device)


def _attend(q: Tensor, k: Tensor, v: Tensor, o: _Options) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """``q (B, N_q, H_q, D)``, ``k (B, N_k, H_kv, D)``, ``v (B, N_k, H_kv, D_v)`` -> flash-attn's outputs."""
    layout = "(batch_size, seqlen, nheads, headdim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_rank(name, t, layout)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # (B, N, H, D) -> (B, H, N, D), views
    state = torch.get_rng_state() if o.wants_weights else None
    out, lse = flash_attention(
        qh,
        kh,
        vh,
        causal=o.causal,
        causal_align="bottom_right",
        scale=o.scale,
        enable_gqa=True,
        window=o.window,
        softcap=o.softcap,
        alibi_slopes=o.alibi_slopes,
        dropout_p=o.dropout_p,
        deterministic=o.deterministic,
        return_lse=True,
    )
    out = out.transpose(1, 2).contiguous()  # (B, H_q, N_q, D_v) -> (B, N_q, H_q, D_v)
    if not o.return_attn_probs:
        return out
    if state is None:
        return out, lse, _no_weights(q)
    B, H_q, N_q, N_k = *lse.shape, kh.shape[-2]
    weights = signed_weights(
        qh,
        kh,
        scale=o.scale,
        causal=o.causal,
        window=o.window,
        softcap=o.softcap,
        alibi_slopes=o.alibi_slopes,
        key=replayed_key(state, o.dropout_p),
        bh=torch.arange(B * H_q, device=q.device).reshape(B, H_q, 1, 1),  # b * H_q + h, the counters' head
        rows=torch.arange(N_q, device=q.device)[:, None],
        cols=torch.arange(N_k, device=q.device),
        counter_shape=(N_q, N_k),
    )
    return out, lse, weights


@dataclass(frozen=True)
class _Packing:
    """flash-attn's varlen bounds: ``cu_seqlens_q, cu_seqlens_k (B + 1,)`` and the longest lengths."""

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def _attend_varlen(
    q: Tensor, k: Tensor, v: Tensor, bounds: _Packing, o: _Options, block_table: Tensor | None
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """``q (total_q, H_q, D)``, ``k, v (total_k, H_kv, D)`` (or page pools with ``block_table``) -> outputs."""
    _check_rank("q", q, "(total_q, nheads, headdim)")
    if block_table is not None:
        pools = "(num_blocks, page_block_size, nheads_k, headdim)"
        k, v = (_check_rank(name, t, pools).transpose(1, 2) for name, t in (("k", k), ("v", v)))  # views
    else:
        for name, t in (("k", k), ("v", v)):
            _check_rank(name, t, "(total_k, nheads_k, headdim)")
    state = torch.get_rng_state() if o.wants_weights else None
    out, lse = flash_attention_varlen(
        q,
        k,
        v,
        bounds.cu_seqlens_q,
        bounds.cu_seqlens_k,
        bounds.max_seqlen_q,
        bounds.max_seqlen_k,
        causal=o.causal,
        scale=o.scale,
        window=o.window,
        softcap=o.softcap,
        alibi_slopes=o.alibi_slopes,
        dropout_p=o.dropout_p,
        deterministic=o.deterministic,
        block_table=block_table,
        return_lse=True,
    )
    if not o.return_attn_probs:
        return out
    if state is None:
        return out, lse, _no_weights(q)
    if block_table is not None:  # the keys each sequence read, packed as without pages
        k, v = gather_paged_keys(q, k, v, bounds.cu_seqlens_k, block_table)
    return out, lse, _packed_weights(q, k, bounds, o, replayed_key(state, o.dropout_p))


def _packed_weights(q: Tensor, k: Tensor, bounds: _Packing, o: _Options, key: DropoutKey) -> Tensor:
    """``S_dmask (B, H_q, max_seqlen_q, max_seqlen_k)``: sequence b's weights at ``[:len_q[b], :len_k[b]]``,
    each sequence's dropout counters in the packed ``total_q x total_k`` matrix (:mod:`flashattn_teach.api.varlen`)."""
    cq, ck = bounds.cu_seqlens_q.tolist(), bounds.cu_seqlens_k.tolist()
    total_q, H_q, total_k = q.shape[0], q.shape[1], k.shape[0]
    weights = q.new_zeros(len(cq) - 1, H_q, bounds.max_seqlen_q, bounds.max_seqlen_k)
    heads = torch.arange(H_q, device=q.device)[:, None, None]  # the packed call is one batch element
    for b, (q0, q1, k0, k1) in enumerate(zip(cq[:-1], cq[1:], ck[:-1], ck[1:], strict=True)):
        if q1 == q0 or k1 == k0:
            continue
        slopes = o.alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        weights[b, :, : q1 - q0, : k1 - k0] = signed_weights(
            q[q0:q1].transpose(0, 1),  # (len_q, H_q, D) -> (H_q, len_q, D)
            k[k0:k1].transpose(0, 1),
            scale=o.scale,
            causal=o.causal,
            window=o.window,
            softcap=o.softcap,
            alibi_slopes=slopes,
            key=key,
            bh=heads,
            rows=torch.arange(q0, q1, device=q.device)[:, None],
            cols=torch.arange(k0, k1, device=q.device),
            counter_shape=(total_q, total_k),
        )
    return weights


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
    opts = _Options.of(
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        deterministic=deterministic,
        return_attn_probs=return_attn_probs,
    )
    return _attend(q, k, v, opts)


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
    k, v = _unpack("kv", kv, 2, 2, "(batch_size, seqlen_k, 2, nheads_k, headdim)")
    opts = _Options.of(
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        deterministic=deterministic,
        return_attn_probs=return_attn_probs,
    )
    return _attend(q, k, v, opts)


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
    q, k, v = _unpack("qkv", qkv, 2, 3, "(batch_size, seqlen, 3, nheads, headdim)")
    opts = _Options.of(
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        deterministic=deterministic,
        return_attn_probs=return_attn_probs,
    )
    return _attend(q, k, v, opts)


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
    opts = _Options.of(
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        deterministic=deterministic,
        return_attn_probs=return_attn_probs,
    )
    bounds = _Packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _attend_varlen(q, k, v, bounds, opts, block_table)


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
    k, v = _unpack("kv", kv, 1, 2, "(total_k, 2, nheads_k, headdim)")
    opts = _Options.of(
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        deterministic=deterministic,
        return_attn_probs=return_attn_probs,
    )
    bounds = _Packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _attend_varlen(q, k, v, bounds, opts, None)


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
    q, k, v = _unpack("qkv", qkv, 1, 3, "(total, 3, nheads, headdim)")
    opts = _Options.of(
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        deterministic=deterministic,
        return_attn_probs=return_attn_probs,
    )
    bounds = _Packing(cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    return _attend_varlen(q, k, v, bounds, opts, None)


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
    causal or windowed, else all at ``cache_seqlens[b]`` (:mod:`flashattn_teach.integrations.rotary`;
    ``rotary_interleaved`` picks the pairs). Masks align bottom-right to each element's length. See
    :func:`flashattn_teach.flash_attention_with_kvcache` for the checks, the splits and the gradients."""
    layout = "(batch_size, seqlen, nheads, headdim)"
    _check_rank("q", q, layout)
    pools = "(num_blocks, page_block_size, nheads_k, headdim)" if block_table is not None else layout
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_rank(name, t, pools)
    for name, new in (("k", k), ("v", v)):
        if new is not None:
            _check_rank(name, new, layout)
    window = _window(window_size)
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
        rows = _cache_rows(cache_batch_idx, B, k_cache, block_table)
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
        softcap=_softcap(softcap),
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


def _cache_rows(cache_batch_idx: object, B: int, k_cache: Tensor, block_table: Tensor | None) -> Tensor:
    """``cache_batch_idx`` checked: an integer ``(B,)`` tensor of rows of the caches, without pages."""
    if block_table is not None:
        raise AttentionValueError(
            "cache_batch_idx selects rows of contiguous caches; with block_table the table already says which "
            "pages each element reads: pass one or the other"
        )
    if (
        not isinstance(cache_batch_idx, Tensor)
        or cache_batch_idx.is_floating_point()
        or cache_batch_idx.dtype == torch.bool
        or tuple(cache_batch_idx.shape) != (B,)
    ):
        got = shape_str(cache_batch_idx) if isinstance(cache_batch_idx, Tensor) else type(cache_batch_idx).__name__
        raise AttentionTypeError(f"cache_batch_idx must be an integer tensor of shape ({B},), got {got}")
    rows = cache_batch_idx.long()
    if values_on_host(rows) and B and not (0 <= int(rows.min()) and int(rows.max()) < k_cache.shape[0]):
        raise AttentionValueError(
            f"cache_batch_idx must lie in [0, {k_cache.shape[0]}) (the caches' rows), got {rows.tolist()}"
        )
    return rows
