"""Attention over packed sequences as one torch operator, so one compiled graph serves every packing.

Traced through as Python, :func:`flashattn_teach.flash_attention_varlen` reads ``cu_seqlens`` into Python
ints (to check them and to build the mask contract's per-sequence tiles), so ``torch.compile`` guards on
every sequence bound and recompiles for each new packing. As an op, the bounds stay tensors that the graph
never looks into, ``max_seqlen_q, max_seqlen_k`` stay symbolic ints (nothing in the graph branches on
them), and the outputs' shapes come from ``q`` and ``v`` alone::

    flashattn_teach::attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        alibi_slopes, <options>, dropout_p, dropout_seed) -> (O (total_q, H_q, D_v), lse (H_q, total_q))
    flashattn_teach::attention_varlen_backward(dO, dlse, q, k, v, <the same>) -> (dq, dk, dv)

The implementations are the eager call (the Triton varlen kernels for CUDA tensors they can run, the CPU
paths otherwise); the backward recomputes the forward under autograd and differentiates it, as
:mod:`flashattn_teach.ops` does. Slopes that need a gradient (only the dense path gives one) are traced
through instead. Dropout is keyed as in :mod:`flashattn_teach.ops`: the caller draws the seed as a tensor
(:func:`flashattn_teach.ops.dropout_args`) and the op and its backward build the same ``DropoutKey`` from it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._layout import compute_dtype
from ._options import AttentionOptions
from ._validate_varlen import check_packed_qkv
from .dropout import DropoutKey
from .errors import AttentionTypeError, AttentionValueError
from .ops import dropout_args, recomputed_grads


def _eager(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    alibi_slopes: Tensor | None,
    causal: bool,
    causal_align: str,
    scale: float | None,
    window: list[int] | None,
    softcap: float | None,
    backend: str,
    dropout_p: float,
    dropout_seed: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """The eager call the op stands for (validation of the bounds' values included), with the dropout key
    from ``dropout_seed``."""
    from .varlen import packed_attention

    if dropout_p > 0.0 and dropout_seed is None:
        raise AttentionValueError(f"dropout_p={dropout_p} needs a dropout_seed (an int64 tensor, see dropout_args)")
    key = DropoutKey(dropout_p, seed=int(dropout_seed)) if dropout_seed is not None and dropout_p > 0.0 else None
    return packed_attention(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal=causal,
        causal_align=causal_align,
        scale=scale,
        window=None if window is None else (window[0], window[1]),
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        dropout_p=dropout_p,
        backend=backend,
        dropout_key=key,
    )


@torch.library.custom_op("flashattn_teach::attention_varlen", mutates_args=())
def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    alibi_slopes: Tensor | None,
    causal: bool,
    causal_align: str,
    scale: float | None,
    window: list[int] | None,
    softcap: float | None,
    backend: str,
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of :func:`flashattn_teach.flash_attention_varlen` called with these arguments, dropout
    keyed by ``dropout_seed`` (an int64 scalar, needed when ``dropout_p > 0``)."""
    with torch.no_grad():
        return _eager(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            alibi_slopes,
            causal,
            causal_align,
            scale,
            window,
            softcap,
            backend,
            dropout_p,
            dropout_seed,
        )


@attention_varlen.register_fake
def _attention_varlen_fake(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *options: object
) -> tuple[Tensor, Tensor]:
    """``O (total_q, H_q, D_v)`` in ``q``'s dtype and ``lse (H_q, total_q)`` in the compute dtype, from the
    shapes alone, which are checked here, at trace time, as the eager call checks them (here rather than
    in the traced caller, where some torch versions replace an error's message by their own)."""
    check_packed_qkv(q, k, v)
    _check_bounds("cu_seqlens_q", cu_seqlens_q, q.device)
    _check_bounds("cu_seqlens_k", cu_seqlens_k, q.device)
    total_q, H_q, _ = q.shape
    return q.new_empty(total_q, H_q, v.shape[2]), q.new_empty(H_q, total_q, dtype=compute_dtype(q.dtype))


@torch.library.custom_op("flashattn_teach::attention_varlen_backward", mutates_args=())
def attention_varlen_backward(
    dO: Tensor,
    dlse: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    alibi_slopes: Tensor | None,
    causal: bool,
    causal_align: str,
    scale: float | None,
    window: list[int] | None,
    softcap: float | None,
    backend: str,
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` for the gradients ``dO`` of ``O`` and ``dlse`` of ``lse``, in the inputs' shapes; the
    forward's dropout mask drawn again from the same ``dropout_seed``."""

    def forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        bounds = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes)
        return _eager(q, k, v, *bounds, causal, causal_align, scale, window, softcap, backend, dropout_p, dropout_seed)

    return recomputed_grads(forward, q, k, v, dO, dlse)


@attention_varlen_backward.register_fake
def _attention_varlen_backward_fake(
    dO: Tensor, dlse: Tensor, q: Tensor, k: Tensor, v: Tensor, *options: object
) -> tuple[Tensor, ...]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    # the dispatcher passes every argument, defaults included: the seed is the last
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, *options, dropout_seed = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed)
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
    ctx.options = options  # the flags, then dropout_p


def _backward(ctx: Any, dO: Tensor, dlse: Tensor) -> tuple[Tensor | None, ...]:
    q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed = ctx.saved_tensors
    bounds = (cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens, alibi_slopes)
    grads = attention_varlen_backward(dO, dlse, q, k, v, *bounds, *ctx.options, dropout_seed)
    # no gradient into the bounds, slopes, options or the seed
    return (*grads, *(None,) * (len(bounds) + len(ctx.options) + 1))


attention_varlen.register_autograd(_backward, setup_context=_setup_context)


def _check_bounds(name: str, cu: Tensor, device: torch.device) -> None:
    """What can be checked of ``cu_seqlens`` without reading it: a 1-D int32/int64 tensor on ``q``'s device
    (its values are checked by the eager call, when the op runs)."""
    if cu.dtype not in (torch.int32, torch.int64):
        raise AttentionTypeError(f"{name} must be int32 or int64, got {cu.dtype} with shape {tuple(cu.shape)}")
    if cu.dim() != 1:
        raise AttentionValueError(f"{name} must be 1-D of shape (B + 1,), got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise AttentionValueError(f"{name} is on {cu.device} but q is on {device}")


def compiled_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    alibi_slopes: Tensor | None,
    opts: AttentionOptions,
    backend: str,
    *,
    scale_given: bool,
) -> tuple[Tensor, Tensor]:
    """The op standing for one call of ``flash_attention_varlen`` while it is compiled: ``opts`` holds the
    call's checked scalar options (of the ``(H, total, D)`` views); the op checks the bounds' values when
    it runs. Its dropout seed is drawn here."""
    spec = opts.mask
    return attention_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        alibi_slopes,
        opts.causal,
        opts.causal_align,
        opts.scale if scale_given else None,  # None: the op takes 1 / sqrt(D), no square root in the graph
        None if spec.left == spec.right == -1 else [spec.left, spec.right],
        spec.softcap,
        backend,
        *dropout_args(opts.dropout_p),
    )
