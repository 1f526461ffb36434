"""Packed variable-length sequences (flash-attn's varlen) in the fused kernels.

:func:`flashattn_teach.flash_attention_varlen` views the packed ``(total, H, D)`` tensors as one batch
element ``(H, total, D)``; the kernels see it as ``(1, H, total, D)`` and run with ``VARLEN``: the grid's
batch index becomes the sequence b, ``cdiv(max_seqlen, BLOCK) * B * H`` programs, each reading
``cu_seqlens[b], cu_seqlens[b + 1]`` for its sequence's rows, lengths and causal offset, and leaving at
once when its block starts past the sequence's end (see :func:`~.masking._sequence`). Tiles across two
sequences are never formed, so the work is that of B separate calls in one launch. Dropout draws the
counters of the packed ``total_q x total_k`` matrix, as the CPU paths do (``flashattn_teach.api.varlen``): each
program shifts the key's offset by its sequence's start rows (:func:`~.dropout._packed_dropout`).

Like the rest of the package this file does not import triton; the kernels are imported on first launch.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .._autocast import cast_inputs
from .._options import AttentionOptions, make_packed_options
from .._validate.inputs import check_bool
from .._validate.varlen import PackedBounds
from ..errors import AttentionError, AttentionValueError, BackendUnavailableError
from .configs import AttentionConfig
from .support import call_unsupported_reason, triton_installed
from .variants import KernelVariants


def triton_varlen_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    opts: AttentionOptions,
    *,
    config: AttentionConfig | None = None,
) -> tuple[Tensor, Tensor]:
    """``(O (H_q, total_q, D_v), lse (H_q, total_q))`` of validated ``(H, total, D)`` views by the fused
    kernels, differentiable with respect to ``q, k, v``; raises if the kernels cannot run the call. With
    ``opts.dropout_p > 0`` the key is ``opts.dropout`` (draw it first: ``opts.with_dropout()``)."""
    from .autograd import TritonAttentionFunction, TritonLaunch
    from .configs import check_backward_config
    from .devices import needs_grad
    from .launch import default_config

    if not triton_installed():
        raise AttentionError("backend='triton' needs the triton package, which is not installed")
    reason = call_unsupported_reason(q, k, v, opts)
    if reason is not None:
        raise AttentionValueError(reason)
    packed = opts.mask.packed
    if packed is None:
        raise AttentionValueError("triton_varlen_forward needs the options of packed sequences (make_packed_options)")
    s = opts.shapes
    variants = replace(
        KernelVariants.from_spec(opts.mask, opts.dropout),  # the counters of the packed matrix (varlen.py)
        cu_seqlens_q=packed.cu_q_t.to(torch.int32).contiguous(),
        cu_seqlens_k=packed.cu_k_t.to(torch.int32).contiguous(),
        max_seqlen_q=packed.longest_q,
        max_seqlen_k=packed.longest_k,
    )
    if config is None:
        config = default_config(q, s, variants)
    if needs_grad(q, k, v):
        check_backward_config(config, q, s)  # fail at the call, not at loss.backward()
    O, lse = TritonAttentionFunction.apply(q, k, v, opts, TritonLaunch(config, variants), opts.sinks)
    return O, lse


def triton_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    causal_align: str = "bottom_right",
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`flashattn_teach.flash_attention_varlen` with ``backend="triton"`` (see there): the same
    checks, then the kernels, which raise where they cannot run the call."""
    q, k, v = cast_inputs(q, k, v)
    if isinstance(alibi_slopes, Tensor) and alibi_slopes.requires_grad:
        raise BackendUnavailableError(
            "backend='triton' cannot run this call: alibi_slopes requires grad, which only the dense path "
            "differentiates; use flash_attention_varlen with backend='dense' or 'auto'"
        )
    qh, kh, vh, opts = make_packed_options(
        q,
        k,
        v,
        PackedBounds(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
        causal=causal,
        causal_align=causal_align,
        scale=scale,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        dropout_p=dropout_p,
    )
    O, lse = triton_varlen_forward(qh, kh, vh, opts.with_dropout())
    O = O.transpose(0, 1).contiguous()  # (H_q, total_q, D_v) -> (total_q, H_q, D_v), flash-attn's layout
    return (O, lse) if check_bool("return_lse", return_lse) else O
