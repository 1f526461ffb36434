"""The public attention functions and the choice of backend behind them.

Backends:
    "triton"     fused Triton kernels (CUDA tensors; see ``flashattn_teach.triton``)
    "parallel"   query-major tiles, the (batch, head) slices spread over worker threads (the fast CPU path)
    "online"     query-major online-softmax CPU reference: the readable tile-by-tile loop
    "key_major"  key-major reference, FlashAttention's Algorithm 1 loop order
    "dense"      the dense oracle: holds all N_q x N_k scores

Masks and attention variants (``window``, ``softcap``, ``alibi_slopes``, ``seqlens_k``, ``attn_mask``; see
``masks.py``) run tile by tile on every CPU backend and in the "triton" kernels (the mask read tile by
tile), so ``auto`` runs them on Triton for CUDA tensors. Dropout is the same on every backend: a
counter-based generator (``dropout.py``) keyed once per call from torch's generator, so every path drops
the same weights for the same key.

``backend="auto"`` picks the fastest backend that can honour every argument; :func:`flashattn_teach.explain`
(``explanation.py``) says which one and why. An explicitly named backend that cannot honour an argument
raises ``NotImplementedError`` instead of silently doing something else.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from dataclasses import dataclass
from types import FrameType
from typing import Literal, overload

import torch
from torch import Tensor

from . import ops
from ._autocast import cast_inputs
from ._options import AttentionOptions, make_options
from ._validate import check_bool
from .errors import AttentionValueError
from .reference.defaults import DEFAULT_BLOCK_M, DEFAULT_BLOCK_N, PARALLEL_BLOCK_M, PARALLEL_BLOCK_N
from .reference.dense import dense_forward
from .reference.online import tiled_attention
from .reference.workers import default_workers
from .rows import fold, unfold

BACKENDS = ("auto", "triton", "parallel", "online", "key_major", "dense")
_RENAMED = {"keymajor": "key_major"}  # deprecated spellings still accepted, with a warning
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # warnings name the first frame outside it
# The tiled CPU backends: their loop order and tile sizes.
_TILED = {
    "parallel": ("parallel", PARALLEL_BLOCK_M, PARALLEL_BLOCK_N),
    "online": ("query_major", DEFAULT_BLOCK_M, DEFAULT_BLOCK_N),
    "key_major": ("key_major", DEFAULT_BLOCK_M, DEFAULT_BLOCK_N),
}
# A decode step's few rows (up to FEW_ROWS, after folding query heads into rows) take wide key tiles: one
# step of q (2, 8, 1, 64) over 540 keys with a padding mask went from 10.2 ms to 5.5 ms at 2048 keys per
# tile, and to 2.0 ms with the query heads folded into rows as well (idle 2-core machine, a one-off script
# timing 50 calls; torch's SDPA 0.10 ms).
# flash_attention_with_kvcache's ranges take the same tiles (decode_cpu.py): a step of B=4, H_q=32, H_kv=8,
# D=128 over caches of 8191, 4000, 100 and 8000 keys took about 90 ms at 2048 keys per tile, 207 ms at 256.
FEW_ROWS = 64
FEW_ROWS_BLOCK_N = 2048


@dataclass(frozen=True)
class Plan:
    """Which backend runs a call, and why."""

    backend: str
    reason: str

    def __str__(self) -> str:
        return f"{self.backend}: {self.reason}"


def _triton_unsupported(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions) -> str | None:
    """None if the Triton backend can run these inputs, else why not."""
    try:
        tr = importlib.import_module("flashattn_teach.triton")
    except ImportError as e:
        return f"the Triton backend is unavailable ({e})"
    reason: str | None = tr.variants_unsupported_reason(opts) or tr.shapes_unsupported_reason(q, k, v, opts.shapes)
    return reason


def _transforms_active() -> bool:
    """Whether a torch.func transform (grad, vmap, jvp, ...) is running around this call."""
    return bool(torch._C._are_functorch_transforms_active())


def check_backend(backend: object) -> str:
    """``backend`` as one of :data:`BACKENDS`, for every public function (``flash_attention``, varlen, the
    KV-cache call): a deprecated spelling warns, pointing at the caller's line outside this package, and
    becomes its new name; anything else raises."""
    if isinstance(backend, str) and backend in _RENAMED:
        new = _RENAMED[backend]
        frame: FrameType | None = sys._getframe(1)
        level = 2  # the caller of this function
        while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
            frame, level = frame.f_back, level + 1
        warnings.warn(f"backend={backend!r} is deprecated; use {new!r}", DeprecationWarning, stacklevel=level)
        return new
    if backend not in BACKENDS:
        raise AttentionValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return str(backend)


def _dense_only(opts: AttentionOptions) -> str | None:
    """Why only the dense path can run this call, or None."""
    tensors = (("attn_mask", opts.attn_mask), ("alibi_slopes", opts.mask.alibi_slopes))
    differentiated = [name for name, t in tensors if t is not None and t.requires_grad]
    if differentiated:
        return f"{' and '.join(differentiated)} requires grad, which only the dense path differentiates"
    if opts.attn_mask is not None and _transforms_active():
        return "an attn_mask under a torch.func transform is only supported by the dense path"
    return None


def plan(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, backend: str = "auto") -> Plan:
    """Choose a backend for validated inputs; raises ``NotImplementedError`` for an incapable named one."""
    backend = check_backend(backend)
    needs_dense = _dense_only(opts)
    variants = ", ".join(opts.mask.variants)  # empty for plain (causal) attention

    if backend == "auto":
        if needs_dense:
            return Plan("dense", needs_dense + " (it holds all N_q x N_k scores)")
        if q.is_cuda:
            why_not = _triton_unsupported(q, k, v, opts)
            if why_not is None:
                return Plan("triton", "CUDA tensors: the fused Triton kernels")
            return Plan("online", f"CUDA tensors, but the Triton path cannot run them: {why_not}")
        if _transforms_active():
            return Plan(
                "online",
                "a torch.func transform is active: the query-major reference in this thread "
                "(the parallel path's worker threads would not see the transform)",
            )
        masked = f"; {variants} read tile by tile" if variants else ""
        return Plan(
            "parallel",
            f"{q.device.type} tensors: query-major tiles, the (batch, head) slices spread over "
            f"{default_workers()} single-threaded workers{masked}",
        )

    if needs_dense and backend != "dense":
        raise NotImplementedError(f"backend={backend!r} cannot run this call: {needs_dense}; use 'dense' or 'auto'")
    if backend == "triton":
        why_not = _triton_unsupported(q, k, v, opts)
        if why_not is not None:
            raise NotImplementedError(f"backend='triton' cannot run this call: {why_not}")
    if backend == "parallel" and _transforms_active():
        raise NotImplementedError(
            "backend='parallel' cannot run under a torch.func transform (its worker threads would not see "
            "it); use 'online' or 'auto'"
        )
    return Plan(backend, "requested explicitly")


def _tiles(backend: str, N_q: int) -> tuple[str, int, int]:
    """``(order, block_m, block_n)`` of a tiled backend. A call with few query rows (a decode step) takes
    key tiles of at least ``FEW_ROWS_BLOCK_N``: its score tiles stay small, and fewer tiles mean fewer
    Python-level ops per row."""
    order, block_m, block_n = _TILED[backend]
    return (order, block_m, max(block_n, FEW_ROWS_BLOCK_N)) if N_q <= FEW_ROWS else (order, block_m, block_n)


def _run(p: Plan, q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` from the planned backend; a call with dropout draws its key here, once."""
    opts = opts.with_dropout()
    if p.backend == "dense":
        return dense_forward(q, k, v, opts)
    if p.backend == "triton":
        from .triton import triton_forward

        return triton_forward(q, k, v, opts, dropout=opts.dropout)
    folded = None if _transforms_active() else fold(q, k, v, opts)
    if folded is not None:  # one query per head: the query heads of a key/value head as its rows (rows.py)
        q_rows, rows = folded
        order, block_m, block_n = _tiles(p.backend, q_rows.shape[2])
        return unfold(*tiled_attention(q_rows, k, v, rows, order=order, block_m=block_m, block_n=block_n), q.shape[1])
    order, block_m, block_n = _tiles(p.backend, q.shape[-2])
    return tiled_attention(q, k, v, opts, order=order, block_m=block_m, block_n=block_n)


@overload
def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    enable_gqa: bool = True,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    seqlens_k: Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    return_lse: Literal[False] = False,
) -> Tensor: ...


@overload
def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    enable_gqa: bool = True,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    seqlens_k: Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    return_lse: Literal[True],
) -> tuple[Tensor, Tensor]: ...


@overload
def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    enable_gqa: bool = True,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    seqlens_k: Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]: ...


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    enable_gqa: bool = True,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    seqlens_k: Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention without storing the ``N_q x N_k`` score matrix.

    Args:
        q: ``(..., H_q, N_q, D)``; k: ``(..., H_kv, N_k, D)``; v: ``(..., H_kv, N_k, D_v)``.
        causal: causal masking; ``causal_align`` is ``"top_left"`` (torch: query i sees keys j <= i) or
            ``"bottom_right"`` (flash-attn: j <= i + N_k - N_q, as in a decode step against a KV cache;
            ``N_k`` is ``seqlens_k[b]`` when given).
        scale: softmax scale, default ``1 / sqrt(D)``.
        enable_gqa: allow fewer key/value heads than query heads (on by default, as in flash-attn).
        window: ``(left, right)``, flash-attn's sliding window: query i sees keys
            ``i + off - left <= j <= i + off + right`` (``off`` = 0 for ``top_left``, ``N_k - N_q`` for
            ``bottom_right``, and with ``seqlens_k`` each batch element's own ``seqlens_k[b] - N_q``, as
            flash-attn aligns; -1: unbounded on that side). ``causal=True`` is ``right = 0``.
        softcap: scores become ``softcap * tanh(score / softcap)``, after scaling, before any bias or mask.
        alibi_slopes: ``(H_q,)`` or ``(*batch, H_q)``: ``-slope * |i + off - j|`` added to the scores.
        seqlens_k: integer tensor of the batch shape (``(B,)`` for 4-D inputs): keys
            ``j >= seqlens_k[b]`` are invisible (right padding).
        attn_mask: bool (True = visible) or additive, broadcast to ``(..., H_q, N_q, N_k)`` as torch's SDPA.
            See :mod:`flashattn_teach.masks` for how these compose and how tiles are skipped.
        dropout_p: zero each attention weight with this probability and scale the rest by
            ``1 / (1 - dropout_p)`` (``lse`` stays undropped), tile by tile inside the online update. The
            mask comes from a counter-based generator (:mod:`flashattn_teach.dropout`) keyed once per call
            from torch's default generator, so ``torch.manual_seed`` makes calls repeatable; the backward
            draws it again rather than storing it.
        backend: one of ``"auto", "triton", "parallel", "online", "key_major", "dense"``; see
            :func:`explain`.
        return_lse: also return ``lse`` of shape ``(..., H_q, N_q)`` (float32, float64 for float64 inputs).

    Returns:
        ``O`` of shape ``(..., H_q, N_q, D_v)`` in ``q``'s dtype (the autocast dtype under
        ``torch.autocast``, as torch's SDPA) and, with ``return_lse``, ``lse``. Differentiable on every
        backend, also under the torch.func transforms on the CPU backends; a query row that sees no key
        gives 0 (and ``lse = -inf``).
    """
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
    )
    lse_wanted = check_bool("return_lse", return_lse)
    if torch.compiler.is_compiling() and ops.traceable(attn_mask, alibi_slopes):
        # A deprecated spelling is warned about by the op when it runs (a warning cannot be traced).
        if not (isinstance(backend, str) and backend in _RENAMED):
            backend = check_backend(backend)
        # one opaque op in the graph instead of the traced tile loops (see ops.py), called with the checked
        # arguments; its dropout seed is drawn here
        O, lse = ops.attention(
            q, k, v, attn_mask, alibi_slopes, seqlens_k, *ops.flags(opts, backend, scale_given=scale is not None)
        )
    else:
        O, lse = _run(plan(q, k, v, opts, backend), q, k, v, opts)
    return (O, lse) if lse_wanted else O


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``: same signature and behaviour.

    ``query (..., H_q, L, E)``, ``key (..., H_kv, S, E)``, ``value (..., H_kv, S, E_v)`` ->
    ``(..., H_q, L, E_v)``. ``attn_mask`` is bool (True = take part) or additive (the query's dtype or
    float32), broadcast to ``(..., L, S)``; with ``is_causal=True`` as well, both apply, as in torch's CPU
    SDPA. Heads broadcast as in torch. ``dropout_p`` applies whenever it is above 0, as in torch (SDPA has
    no training flag: pass 0 in eval), from this library's counter-based generator, so the mask differs from
    torch's for the same seed. Calls with a mask that requires grad run on the dense path; the rest, masks
    and dropout included, run on a path that never stores the score matrix, a mask read tile by tile
    (:func:`explain` tells which). Errors are both
    ``RuntimeError`` (as torch raises) and ``ValueError``/``TypeError``; the README lists where this
    function deliberately differs from torch.
    """
    query, key, value = cast_inputs(query, key, value)
    opts = make_options(
        query,
        key,
        value,
        causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        causal_name="is_causal",
    )
    if torch.compiler.is_compiling() and ops.traceable(attn_mask, None):
        O, _ = ops.attention(
            query, key, value, attn_mask, None, None, *ops.flags(opts, "auto", scale_given=scale is not None)
        )
    else:
        O, _ = _run(plan(query, key, value, opts), query, key, value, opts)
    return O
