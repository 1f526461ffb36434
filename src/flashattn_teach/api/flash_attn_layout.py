"""flash-attn's layout and options in this library's terms, for :mod:`flashattn_teach.flash_attn_interface`.

flash-attn's functions take ``(B, N, H, D)`` (packed: ``(total, H, D)``) and options spelt its way; each is
checked here once (:class:`FlashAttnOptions`), the tensors are viewed in this library's ``(B, H, N, D)`` layout
(transposes, no copies), the public functions of :mod:`flashattn_teach.api` run the call, and the results
come back in flash-attn's layout, with ``S_dmask`` (:mod:`flashattn_teach.reference.flash_attn_probs`) when
asked for.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .._options import PackedKeywords
from .._validate.inputs import check_bool, real_number, shape_str, values_on_host
from ..errors import AttentionTypeError, AttentionValueError
from ..reference.flash_attn_probs import signed_weights
from ..serving.varlen_pages import gather_paged_keys
from .attention import flash_attention
from .varlen import flash_attention_varlen


@dataclass(frozen=True)
class FlashAttnOptions:
    """The options every flash-attn function shares, checked once and in this library's terms: ``keywords``
    are :func:`flashattn_teach.flash_attention_varlen`'s (:class:`flashattn_teach._options.PackedKeywords`),
    aligned bottom-right as flash-attn aligns, passed whole to this library's functions."""

    keywords: PackedKeywords
    return_attn_probs: bool

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> FlashAttnOptions:
        """The options of a flash-attn call from its arguments by flash-attn's names (``dropout_p``,
        ``softmax_scale``, ``causal``, ``window_size``, ``softcap``, ``alibi_slopes``, ``deterministic``,
        ``return_attn_probs``): the ``locals()`` of a function whose signature is flash-attn's, written out."""
        probs = check_bool("return_attn_probs", arguments["return_attn_probs"])
        p = real_number("dropout_p", arguments["dropout_p"])
        if probs and p > 0.0 and torch.compiler.is_compiling():
            raise AttentionValueError(
                "return_attn_probs=True with dropout_p > 0 under torch.compile: S_dmask replays the generator "
                "state before the call, which a graph does not read; call it eagerly, or pass "
                "return_attn_probs=False"
            )
        keywords = PackedKeywords(
            causal=check_bool("causal", arguments["causal"]),
            causal_align="bottom_right",
            scale=arguments["softmax_scale"],
            window=window_size_pair(arguments["window_size"]),
            softcap=softcap_or_none(arguments["softcap"]),
            alibi_slopes=arguments["alibi_slopes"],
            dropout_p=p,
            deterministic=check_bool("deterministic", arguments["deterministic"]),
        )
        return cls(keywords, probs)

    @property
    def wants_weights(self) -> bool:
        """Whether ``S_dmask`` holds anything: flash-attn writes it only with dropout."""
        return self.return_attn_probs and self.keywords["dropout_p"] > 0.0


def window_size_pair(window_size: object) -> tuple[int, int]:
    """flash-attn's ``window_size``: two ints (a list, a tuple or an integer tensor), any negative side -1."""
    sides = window_size.tolist() if isinstance(window_size, Tensor) else window_size
    if not isinstance(sides, (tuple, list)) or len(sides) != 2:
        raise AttentionTypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    for w in sides:
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise AttentionTypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    return max(int(sides[0]), -1), max(int(sides[1]), -1)


def softcap_or_none(softcap: object) -> float | None:
    """flash-attn's ``softcap``: a cap when above 0, none otherwise."""
    value = real_number("softcap", softcap)
    return value if value > 0.0 else None


def check_rank(name: str, t: object, layout: str) -> Tensor:
    """``t``, a tensor with as many dimensions as flash-attn's ``layout`` names."""
    rank = len(layout.split(","))
    if not isinstance(t, Tensor) or t.dim() != rank:
        got = shape_str(t) if isinstance(t, Tensor) else type(t).__name__
        raise AttentionValueError(
            f"{name} must be {layout} (flash-attn's layout), got {got}; for torch's (B, H, N, D) layout "
            "call flashattn_teach.flash_attention"
        )
    return t


def unpack(name: str, packed: Tensor, dim: int, count: int, layout: str) -> tuple[Tensor, ...]:
    """``packed`` unbound along ``dim`` into its ``count`` views (q, k, v or k, v)."""
    check_rank(name, packed, layout)
    if packed.shape[dim] != count:
        raise AttentionValueError(f"{name} must be {layout}, got {shape_str(packed)}")
    return packed.unbind(dim)


def _no_weights(q: Tensor) -> Tensor:
    """flash-attn's ``S_dmask`` of a call without dropout: an empty tensor."""
    return torch.empty(0, dtype=q.dtype, device=q.device)


def attend(q: Tensor, k: Tensor, v: Tensor, o: FlashAttnOptions) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """``q (B, N_q, H_q, D)``, ``k (B, N_k, H_kv, D)``, ``v (B, N_k, H_kv, D_v)`` -> flash-attn's outputs."""
    layout = "(batch_size, seqlen, nheads, headdim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_rank(name, t, layout)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # (B, N, H, D) -> (B, H, N, D), views
    state = torch.get_rng_state() if o.wants_weights else None
    out, lse = flash_attention(qh, kh, vh, **o.keywords, enable_gqa=True, return_lse=True)
    out = out.transpose(1, 2).contiguous()  # (B, H_q, N_q, D_v) -> (B, N_q, H_q, D_v)
    if not o.return_attn_probs:
        return out
    if state is None:
        return out, lse, _no_weights(q)
    B, H_q, N_q, N_k = *lse.shape, kh.shape[-2]
    weights = signed_weights(
        qh,
        kh,
        o.keywords,
        alibi_slopes=o.keywords["alibi_slopes"],
        rng_state=state,
        bh=torch.arange(B * H_q, device=q.device).reshape(B, H_q, 1, 1),  # b * H_q + h, the counters' head
        rows=torch.arange(N_q, device=q.device)[:, None],
        cols=torch.arange(N_k, device=q.device),
        counter_shape=(N_q, N_k),
    )
    return out, lse, weights


@dataclass(frozen=True)
class Packing:
    """flash-attn's varlen bounds: ``cu_seqlens_q, cu_seqlens_k (B + 1,)`` and the longest lengths."""

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def attend_varlen(
    q: Tensor, k: Tensor, v: Tensor, bounds: Packing, o: FlashAttnOptions, block_table: Tensor | None
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """``q (total_q, H_q, D)``, ``k, v (total_k, H_kv, D)`` (or page pools with ``block_table``) -> outputs."""
    check_rank("q", q, "(total_q, nheads, headdim)")
    if block_table is not None:
        pools = "(num_blocks, page_block_size, nheads_k, headdim)"
        k, v = (check_rank(name, t, pools).transpose(1, 2) for name, t in (("k", k), ("v", v)))  # views
    else:
        for name, t in (("k", k), ("v", v)):
            check_rank(name, t, "(total_k, nheads_k, headdim)")
    state = torch.get_rng_state() if o.wants_weights else None
    bounds_in_order = (bounds.cu_seqlens_q, bounds.cu_seqlens_k, bounds.max_seqlen_q, bounds.max_seqlen_k)
    out, lse = flash_attention_varlen(q, k, v, *bounds_in_order, **o.keywords, block_table=block_table, return_lse=True)
    if not o.return_attn_probs:
        return out
    if state is None:
        return out, lse, _no_weights(q)
    if block_table is not None:  # the keys each sequence read, packed as without pages
        k, v = gather_paged_keys(q, k, v, bounds.cu_seqlens_k, block_table)
    return out, lse, _packed_weights(q, k, bounds, o, state)


def _packed_weights(q: Tensor, k: Tensor, bounds: Packing, o: FlashAttnOptions, state: Tensor) -> Tensor:
    """``S_dmask (B, H_q, max_seqlen_q, max_seqlen_k)``: sequence b's weights at ``[:len_q[b], :len_k[b]]``,
    each sequence's dropout counters in the packed ``total_q x total_k`` matrix (:mod:`flashattn_teach.api.varlen`)."""
    cq, ck = bounds.cu_seqlens_q.tolist(), bounds.cu_seqlens_k.tolist()
    total_q, H_q, total_k = q.shape[0], q.shape[1], k.shape[0]
    weights = q.new_zeros(len(cq) - 1, H_q, bounds.max_seqlen_q, bounds.max_seqlen_k)
    heads = torch.arange(H_q, device=q.device)[:, None, None]  # the packed call is one batch element
    for b, (q0, q1, k0, k1) in enumerate(zip(cq[:-1], cq[1:], ck[:-1], ck[1:], strict=True)):
        if q1 == q0 or k1 == k0:
            continue
        slopes = o.keywords["alibi_slopes"]
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        weights[b, :, : q1 - q0, : k1 - k0] = signed_weights(
            q[q0:q1].transpose(0, 1),  # (len_q, H_q, D) -> (H_q, len_q, D)
            k[k0:k1].transpose(0, 1),
            o.keywords,
            alibi_slopes=slopes,
            rng_state=state,
            bh=heads,
            rows=torch.arange(q0, q1, device=q.device)[:, None],
            cols=torch.arange(k0, k1, device=q.device),
            counter_shape=(total_q, total_k),
        )
    return weights


def cache_rows(cache_batch_idx: object, B: int, k_cache: Tensor, block_table: Tensor | None) -> Tensor:
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
