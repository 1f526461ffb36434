"""The public attention functions and the choice of backend behind them.

Backends:
    "triton"    fused Triton kernels (CUDA tensors; see ``flashattn_teach.triton``)
    "online"    query-major online-softmax CPU reference (any device torch runs on)
    "keymajor"  key-major reference, FlashAttention's Algorithm 1 loop order
    "dense"     the dense oracle: holds all N_q x N_k scores; the only one with ``attn_mask`` and dropout

``backend="auto"`` picks the fastest backend that can honour every argument; :func:`explain` says which
one and why. An explicitly named backend that cannot honour an argument raises ``NotImplementedError``
instead of silently doing something else.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from torch import Tensor

from ._validate import validate_inputs
from .reference import dense_attention, keymajor_attention, online_attention

BACKENDS = ("auto", "triton", "online", "keymajor", "dense")


@dataclass(frozen=True)
class Plan:
    """Which backend runs a call, and why."""

    backend: str
    reason: str

    def __str__(self) -> str:
        return f"{self.backend}: {self.reason}"


def _triton_unsupported(q: Tensor, k: Tensor, v: Tensor, causal: bool, causal_align: str, enable_gqa: bool):
    """None if the Triton backend can run these inputs, else why not."""
    try:
        tr = importlib.import_module("flashattn_teach.triton")
    except ImportError as e:
        return f"the Triton backend is unavailable ({e})"
    return tr.unsupported_reason(q, k, v, causal=causal, causal_align=causal_align, enable_gqa=enable_gqa)


def plan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    enable_gqa: bool = False,
    backend: str = "auto",
) -> Plan:
    """Validate the arguments and choose a backend; raises for bad input or an incapable named backend."""
    validate_inputs(q, k, v, scale=scale, causal_align=causal_align, enable_gqa=enable_gqa, attn_mask=attn_mask)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    needs_dense = None
    if attn_mask is not None:
        needs_dense = "an explicit attn_mask is only supported by the dense path"
    elif dropout_p > 0.0:
        needs_dense = "dropout is only supported by the dense path"

    if backend == "auto":
        if needs_dense:
            return Plan("dense", needs_dense + " (it holds all N_q x N_k scores)")
        if q.is_cuda:
            why_not = _triton_unsupported(q, k, v, causal, causal_align, enable_gqa)
            if why_not is None:
                return Plan("triton", "CUDA tensors: the fused Triton kernels")
            return Plan("online", f"CUDA tensors, but the Triton path cannot run them: {why_not}")
        return Plan("online", f"{q.device.type} tensors: the query-major online-softmax reference")

    if needs_dense and backend != "dense":
        raise NotImplementedError(f"backend={backend!r} cannot run this call: {needs_dense}; use 'dense' or 'auto'")
    if backend == "triton":
        why_not = _triton_unsupported(q, k, v, causal, causal_align, enable_gqa)
        if why_not is not None:
            raise NotImplementedError(f"backend='triton' cannot run this call: {why_not}")
    return Plan(backend, "requested explicitly")


def _run(p: Plan, q, k, v, *, attn_mask, dropout_p, causal, causal_align, scale, enable_gqa, return_lse):
    if p.backend == "dense":
        return dense_attention(
            q,
            k,
            v,
            causal=causal,
            causal_align=causal_align,
            scale=scale,
            attn_mask=attn_mask,
            enable_gqa=enable_gqa,
            dropout_p=dropout_p,
            return_lse=return_lse,
        )
    if p.backend == "triton":
        from .triton import triton_attention

        return triton_attention(
            q, k, v, causal=causal, causal_align=causal_align, scale=scale, enable_gqa=enable_gqa, return_lse=return_lse
        )
    fn = online_attention if p.backend == "online" else keymajor_attention
    return fn(
        q, k, v, causal=causal, causal_align=causal_align, scale=scale, enable_gqa=enable_gqa, return_lse=return_lse
    )


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    enable_gqa: bool = True,
    backend: str = "auto",
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention without storing the ``N_q x N_k`` score matrix.

    Args:
        q: ``(..., H_q, N_q, D)``; k: ``(..., H_kv, N_k, D)``; v: ``(..., H_kv, N_k, D_v)``.
        causal: causal masking; ``causal_align`` is ``"top_left"`` (torch: query i sees keys j <= i) or
            ``"bottom_right"`` (flash-attn: j <= i + N_k - N_q, as in a decode step against a KV cache).
        scale: softmax scale, default ``1 / sqrt(D)``.
        enable_gqa: allow fewer key/value heads than query heads (on by default, as in flash-attn).
        backend: one of ``"auto", "triton", "online", "keymajor", "dense"``; see :func:`explain`.
        return_lse: also return ``lse`` of shape ``(..., H_q, N_q)`` (float32, float64 for float64 inputs).

    Returns:
        ``O`` of shape ``(..., H_q, N_q, D_v)`` in ``q``'s dtype (and ``lse``). Differentiable on every
        backend; a query row that sees no key gives 0 (and ``lse = -inf``).
    """
    opts = dict(causal=causal, causal_align=causal_align, scale=scale, enable_gqa=enable_gqa)
    p = plan(q, k, v, **opts, backend=backend)
    return _run(p, q, k, v, attn_mask=None, dropout_p=0.0, **opts, return_lse=return_lse)


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``: same signature and semantics.

    ``query (..., H_q, L, E)``, ``key (..., H_kv, S, E)``, ``value (..., H_kv, S, E_v)`` ->
    ``(..., H_q, L, E_v)``. ``attn_mask`` is bool (True = take part) or additive; ``is_causal`` is the
    top-left triangle. Calls with a mask or dropout run on the dense path; the rest run on a path that
    never stores the score matrix (:func:`explain` tells which). One deliberate difference: a query row
    that may attend to nothing returns 0, where torch's math path returns NaN.
    """
    if is_causal and attn_mask is not None:
        raise ValueError("pass either attn_mask or is_causal=True, not both (as torch's SDPA requires)")
    opts = dict(attn_mask=attn_mask, dropout_p=dropout_p, causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return _run(plan(query, key, value, **opts), query, key, value, **opts, causal_align="top_left", return_lse=False)


def explain(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str = "top_left",
    backend: str = "auto",
) -> Plan:
    """Which backend :func:`scaled_dot_product_attention` / :func:`flash_attention` would use, and why.

    >>> import torch, flashattn_teach as fa
    >>> q = torch.randn(1, 2, 8, 16)
    >>> print(fa.explain(q, q, q))
    online: cpu tensors: the query-major online-softmax reference
    """
    return plan(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        causal=is_causal,
        causal_align=causal_align,
        scale=scale,
        enable_gqa=enable_gqa,
        backend=backend,
    )
