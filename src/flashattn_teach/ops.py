"""flashattn_teach as one torch operator, so ``torch.compile`` and ``torch.export`` see one node per call.

Traced through as Python, the tile loops unroll into the graph: every sequence length is a new graph, and
``torch.export`` with a dynamic length fails on the loop bounds. Registered with ``torch.library``, a call
is one opaque op whose output shapes come from a fake (meta) implementation, symbolic in every size, so one
graph serves all lengths. Eager calls do not go through here: :func:`flashattn_teach.flash_attention` and
:func:`flashattn_teach.scaled_dot_product_attention` use these ops only while being compiled or exported
(``torch.compiler.is_compiling()``), and eager behaviour, the torch.func transforms included, is unchanged.

    flashattn_teach::attention(q, k, v, attn_mask, alibi_slopes, seqlens_k, <options>, dropout_p,
        dropout_seed) -> (O, lse)
    flashattn_teach::attention_backward(dO, dlse, q, k, v, <the same>) -> (dq, dk, dv)

The backward op recomputes the forward under autograd and differentiates it (a tiled forward saves only
``q, k, v, O, lse``, so memory stays O(N); the cost is one forward more than the eager backward).

Dropout: an op must be a function of its inputs, so the call's dropout key cannot be drawn inside it. The
caller draws the seed as a tensor (:func:`dropout_args`, the same ``torch.randint`` as the eager
:func:`flashattn_teach.dropout.draw`, but left in the graph rather than read into a Python int) and passes
it in; the op and its backward build ``DropoutKey(dropout_p, seed, offset=0)`` from it, so the backward
draws the forward's mask again (Dao et al. 2022, Alg. 4) and, where the compiled graph runs torch's own
``randint`` (``aot_eager``, or inductor with ``fallback_random``), the mask is eager's for the same seed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from ._layout import compute_dtype
from ._options import AttentionOptions, make_options
from ._validate import check_dropout, validate_inputs
from .dropout import DropoutKey
from .errors import AttentionValueError


def _eager(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    alibi_slopes: Tensor | None,
    seqlens_k: Tensor | None,
    causal: bool,
    causal_align: str,
    scale: float | None,
    window: list[int] | None,
    softcap: float | None,
    enable_gqa: bool,
    backend: str,
    dropout_p: float,
    dropout_seed: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """The eager call the op stands for (validation included), with the dropout key from ``dropout_seed``."""
    from .api import _run, plan

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
        window=None if window is None else (window[0], window[1]),
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        seqlens_k=seqlens_k,
    )
    if opts.dropout_p > 0.0 and dropout_seed is None:
        raise AttentionValueError(f"dropout_p={dropout_p} needs a dropout_seed (an int64 tensor, see dropout_args)")
    key = DropoutKey(opts.dropout_p, seed=int(dropout_seed)) if dropout_seed is not None else DropoutKey()
    return _run(plan(q, k, v, opts, backend), q, k, v, opts.with_dropout(key))


@torch.library.custom_op("flashattn_teach::attention", mutates_args=())
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    alibi_slopes: Tensor | None,
    seqlens_k: Tensor | None,
    causal: bool,
    causal_align: str,
    scale: float | None,
    window: list[int] | None,
    softcap: float | None,
    enable_gqa: bool,
    backend: str,
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of :func:`flashattn_teach.flash_attention` called with these arguments, dropout keyed by
    ``dropout_seed`` (an int64 scalar, needed when ``dropout_p > 0``)."""
    with torch.no_grad():
        O, lse = _eager(
            q,
            k,
            v,
            attn_mask,
            alibi_slopes,
            seqlens_k,
            causal,
            causal_align,
            scale,
            window,
            softcap,
            enable_gqa,
            backend,
            dropout_p,
            dropout_seed,
        )
    # An op's outputs may not alias its inputs or each other; a path may return views (e.g. for empty inputs).
    return O.clone() if O._base is not None else O, lse.clone() if lse._base is not None else lse


@attention.register_fake
def _attention_fake(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    alibi_slopes: Tensor | None,
    seqlens_k: Tensor | None,
    causal: bool,
    causal_align: str,
    scale: float | None,
    window: list[int] | None,
    softcap: float | None,
    enable_gqa: bool,
    backend: str,
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Output shapes from the input shapes alone (symbolic under dynamic shapes): ``O (..., H_q, N_q, D_v)``
    in ``q``'s dtype, ``lse (..., H_q, N_q)`` in the compute dtype."""
    check_dropout(dropout_p)
    s = validate_inputs(q, k, v, scale=scale, causal_align=causal_align, enable_gqa=enable_gqa, attn_mask=attn_mask)
    return q.new_empty(s.out_shape), q.new_empty(s.lse_shape, dtype=compute_dtype(q.dtype))


@torch.library.custom_op("flashattn_teach::attention_backward", mutates_args=())
def attention_backward(
    dO: Tensor,
    dlse: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    alibi_slopes: Tensor | None,
    seqlens_k: Tensor | None,
    causal: bool,
    causal_align: str,
    scale: float | None,
    window: list[int] | None,
    softcap: float | None,
    enable_gqa: bool,
    backend: str,
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` for the gradients ``dO`` of ``O`` and ``dlse`` of ``lse``, in the inputs' shapes;
    the forward's dropout mask drawn again from the same ``dropout_seed``."""

    def forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        options = (causal, causal_align, scale, window, softcap, enable_gqa, backend, dropout_p, dropout_seed)
        return _eager(q, k, v, attn_mask, alibi_slopes, seqlens_k, *options)

    return recomputed_grads(forward, q, k, v, dO, dlse)


@contextlib.contextmanager
def _autograd_dispatch() -> Iterator[None]:
    """Grad mode and the autograd dispatch keys back on. torch.library runs an op's implementation below
    autograd (its autograd kernel excludes those keys), where a torch op records no graph: only an
    ``autograd.Function`` would, so a recompute through the dense path, or through a view taken of a
    Function's output (varlen's transposes), would have nothing to differentiate."""
    K = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (K.AutogradFunctionality, K.AutogradOther, K.AutogradNestedTensor):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def recomputed_grads(
    forward: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dO: Tensor,
    dlse: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of ``(O, lse) = forward(q, k, v)`` for the gradients ``(dO, dlse)``: the forward run
    again under autograd and differentiated, as every backward op here does."""
    with _autograd_dispatch():
        qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
        O, lse = forward(qd, kd, vd)
        dq, dk, dv = torch.autograd.grad((O, lse), (qd, kd, vd), (dO, dlse), allow_unused=True)
    return _laid_out_like(q, dq), _laid_out_like(k, dk), _laid_out_like(v, dv)


def _laid_out_like(t: Tensor, grad: Tensor | None) -> Tensor:
    """``grad`` in ``torch.empty_like(t)``'s layout, the one the fake backward promises: a compiled graph
    reads the result with those strides, and ``q, k, v`` are often strided views (a GPT's ``qkv`` split and
    transposed) while autograd returns other strides. ``None`` (an input the call never read, such as an
    empty sequence) is a zero gradient."""
    out = torch.empty_like(t)
    return out.zero_() if grad is None else out.copy_(grad)


@attention_backward.register_fake
def _attention_backward_fake(
    dO: Tensor, dlse: Tensor, q: Tensor, k: Tensor, v: Tensor, *_: object
) -> tuple[Tensor, ...]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, attn_mask, alibi_slopes, seqlens_k, *options, dropout_seed = inputs
    ctx.save_for_backward(q, k, v, attn_mask, alibi_slopes, seqlens_k, dropout_seed)
    ctx.options = options  # the flags, then dropout_p


def _backward(ctx: Any, dO: Tensor, dlse: Tensor) -> tuple[Tensor | None, ...]:
    *tensors, dropout_seed = ctx.saved_tensors
    grads = attention_backward(dO, dlse, *tensors, *ctx.options, dropout_seed)
    # no gradient into masks, slopes, lengths, options or the seed
    return (*grads, *(None,) * (len(tensors) - 3 + len(ctx.options) + 1))


attention.register_autograd(_backward, setup_context=_setup_context)


def dropout_args(dropout_p: object) -> tuple[float, Tensor | None]:
    """``(dropout_p, dropout_seed)`` for one call: ``(0.0, None)`` without dropout, else the probability and
    the seed as an int64 scalar tensor, the draw of :func:`flashattn_teach.dropout.draw` (the same
    ``torch.randint`` on torch's default CPU generator) kept a tensor so that a graph can hold it (``int()``
    of it would break the graph)."""
    p = check_dropout(dropout_p)
    if p == 0.0:
        return 0.0, None  # a constant, so the graph holds no symbolic float for a call without dropout
    return p, torch.randint(0, 2**62, (), dtype=torch.int64)


def flags(opts: AttentionOptions, backend: str, *, scale_given: bool) -> tuple[Any, ...]:
    """The op's arguments after ``seqlens_k``, from a call's checked options: ``causal, causal_align, scale,
    window, softcap, enable_gqa, backend, dropout_p, dropout_seed``, each in the type the op's schema
    declares (a ``scale`` given as a numpy float or a tensor is a float here, a window a list or None).
    Without ``scale_given`` the scale is None and the op takes ``1 / sqrt(D)`` itself, so a graph with a
    symbolic ``D`` holds no square root."""
    spec = opts.mask
    window = None if spec.left == spec.right == -1 else [spec.left, spec.right]
    return (
        opts.causal,
        opts.causal_align,
        opts.scale if scale_given else None,
        window,
        spec.softcap,
        opts.enable_gqa,
        backend,
        *dropout_args(opts.dropout_p),
    )


def traceable(attn_mask: Tensor | None, alibi_slopes: Tensor | None) -> bool:
    """Whether a call being compiled can be this op: not when a mask or slopes need gradients (the op gives
    none to them; such calls are traced through instead)."""
    return not any(t is not None and t.requires_grad for t in (attn_mask, alibi_slopes))
