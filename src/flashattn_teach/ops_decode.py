"""One decode step as one torch operator, so a compiled decode loop is one graph for every step.

Traced through as Python, :func:`flashattn_teach.flash_attention_with_kvcache` reads ``cache_seqlens``
into Python ints (a loop over the batch, a split per range), so ``torch.compile`` guards on the cache
lengths and recompiles at every step, when they grow by one. As an op, the lengths stay a tensor that the
graph never looks into: one graph serves every step and every cache length, and the op's outputs have the
shapes of ``q``, whatever the lengths::

    flashattn_teach::attention_with_kvcache(q, k_cache!, v_cache!, k, v, cache_seqlens, alibi_slopes,
        <options>) -> (O, lse)

``!``: the op writes ``k, v`` into the caches in place (``mutates_args``), as the eager call does, so the
compiled graph knows the caches change and functionalizes the write. Its implementation is the eager call
(whichever backend that picks, the Triton decode kernel included); its fake implementation gives the
output shapes from ``q`` and ``v_cache`` alone, symbolic in every size.

Decoding is inference: the op has no autograd registration (the eager call does not differentiate the
in-place write either), so a call being compiled that needs a gradient, into ``q`` or a cache read
without new keys, is traced through instead (:func:`traceable`), as it was before the op existed.
"""

from __future__ import annotations

import numbers
from typing import cast

import torch
from torch import Tensor

from ._layout import compute_dtype
from .errors import AttentionTypeError, AttentionValueError


@torch.library.custom_op("flashattn_teach::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def attention_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    cache_seqlens: Tensor,
    alibi_slopes: Tensor | None,
    causal: bool,
    scale: float | None,
    window: list[int] | None,
    softcap: float | None,
    num_splits: int,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of :func:`flashattn_teach.flash_attention_with_kvcache` with these arguments; ``k, v``
    written into ``k_cache, v_cache`` in place."""
    from .decode import flash_attention_with_kvcache

    with torch.no_grad():
        O, lse = flash_attention_with_kvcache(
            q,
            k_cache,
            v_cache,
            k,
            v,
            cache_seqlens=cache_seqlens,
            causal=causal,
            scale=scale,
            window=None if window is None else (window[0], window[1]),
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            num_splits=num_splits,
            backend=backend,
            return_lse=True,
        )
    return O, lse


@attention_with_kvcache.register_fake
def _attention_with_kvcache_fake(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    cache_seqlens: Tensor,
    *options: object,
) -> tuple[Tensor, Tensor]:
    """``O (B, H_q, N_new, D_v)`` in ``q``'s dtype and ``lse (B, H_q, N_new)`` in the compute dtype, from
    the shapes alone. ``cache_seqlens`` is checked here, at trace time, as far as it can be without reading
    it (here rather than in the traced caller, where some torch versions replace an error's message by
    their own); the rest, the shapes of ``q`` and the caches included, is checked by the eager call when
    the op runs (``check_cache_inputs`` puts sizes in a set, which a symbolic size cannot join)."""
    B, H_q, N_new, _ = q.shape
    if cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise AttentionTypeError(f"cache_seqlens must be int32 or int64, got {cache_seqlens.dtype}")
    if cache_seqlens.shape != (B,):
        raise AttentionValueError(f"cache_seqlens must have shape ({B},), got {tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != q.device:
        raise AttentionValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on {q.device}")
    return q.new_empty(B, H_q, N_new, v_cache.shape[3]), q.new_empty(B, H_q, N_new, dtype=compute_dtype(q.dtype))


def _seqlens_tensor(cache_seqlens: object, B: int, device: torch.device) -> Tensor:
    """``cache_seqlens`` as the op takes it, a ``(B,)`` tensor: one int (symbolic under ``dynamic=True``)
    becomes one."""
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        cache_seqlens = int(cache_seqlens)  # a numpy int; a Python int is itself
    if isinstance(cache_seqlens, int | torch.SymInt) and not isinstance(cache_seqlens, bool):
        return torch.full((B,), cast(int, cache_seqlens), dtype=torch.int64, device=device)  # (B,): one length each
    if not isinstance(cache_seqlens, Tensor):
        raise AttentionTypeError(
            f"cache_seqlens must be an int32/int64 torch.Tensor of shape ({B},) or an int, got {cache_seqlens!r}"
        )
    return cache_seqlens


def traceable(*tensors: object) -> bool:
    """Whether a call being compiled can be this op: not when grad mode is on and an input requires grad
    (the op is not differentiated; such calls are traced through, as in eager)."""
    return not (torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors))


def compiled_step(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    *,
    cache_seqlens: Tensor | int,
    causal: bool,
    scale: float | None,
    window: tuple[int, int] | None,
    softcap: float | None,
    alibi_slopes: Tensor | None,
    num_splits: int,
    backend: str,
    return_lse: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    """The op standing for one call of ``flash_attention_with_kvcache`` while it is compiled or exported; a
    tensor or an int ``cache_seqlens`` both give one graph for every length."""
    O, lse = attention_with_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        _seqlens_tensor(cache_seqlens, q.shape[0], q.device),
        alibi_slopes,
        causal,
        scale,
        None if window is None else list(window),
        softcap,
        num_splits,
        backend,
    )
    return (O, lse) if return_lse else O
