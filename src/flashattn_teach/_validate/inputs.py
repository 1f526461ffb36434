"""Input validation shared by every backend (dense, online, key-major, parallel, Triton).

All backends accept torch's ``scaled_dot_product_attention`` layout::

    q: (..., H_q,  N_q, D)      k: (..., H_k, N_k, D)      v: (..., H_v, N_k, D_v)

Leading dimensions broadcast as in ``torch.matmul``, and so do the heads, as in torch: ``H_k`` and
``H_v`` are equal or 1, and ``H_q`` and ``H_kv`` are equal or one of them is 1 (``H_kv = 1`` is
multi-query attention; ``H_q = 1`` gives every key/value head the same queries). With ``enable_gqa=True``
``H_kv`` may also divide ``H_q`` (grouped-query attention: query head ``h`` reads key/value head
``h // (H_q // H_kv)``, torch's ``repeat_interleave`` convention).

Errors are :mod:`flashattn_teach.errors` types (a ``ValueError`` or ``TypeError`` that is also a
``RuntimeError``, as torch raises) and name the argument and the shapes or dtypes involved, so a user can
fix the call without reading this file.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..errors import AttentionDtypeError, AttentionTypeError, AttentionValueError

CAUSAL_ALIGNS = ("top_left", "bottom_right")


@dataclass(frozen=True)
class AttentionShapes:
    """The sizes of one attention call, after broadcasting.

    ``batch`` is the broadcast shape of all leading dimensions (those before the head dimension);
    ``H_q`` is the number of output heads (query heads after broadcasting against the key/value heads);
    ``rank`` is the rank of the output, which has shape ``(*batch, H_q, N_q, D_v)`` (or ``(N_q, D_v)``
    for 2-D inputs); ``scale`` is the softmax scale, resolved (``1 / sqrt(D)`` unless given).
    """

    batch: tuple[int, ...]
    H_q: int
    H_kv: int
    N_q: int
    N_k: int
    D: int
    D_v: int
    rank: int
    scale: float

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 for plain multi-head attention, and for zero heads)."""
        return self.H_q // self.H_kv if self.H_kv else 1

    @property
    def out_shape(self) -> tuple[int, ...]:
        if self.rank == 2:
            return (self.N_q, self.D_v)
        return (*self.batch, self.H_q, self.N_q, self.D_v)

    @property
    def lse_shape(self) -> tuple[int, ...]:
        return self.out_shape[:-1]

    @property
    def score_shape(self) -> tuple[int, ...]:
        """The shape of the scores ``S``, which an ``attn_mask`` must broadcast to."""
        return (*self.out_shape[:-1], self.N_k)


def shape_str(t: Tensor) -> str:
    """``(2, 3, 4)``: a tensor's shape as errors quote it."""
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _qkv_shapes(q: Tensor, k: Tensor, v: Tensor) -> str:
    """The shapes of a call, as its errors quote them; built only when raising (under ``torch.compile``
    with dynamic shapes the sizes are symbols that cannot be formatted while tracing)."""
    return f"query {shape_str(q)}, key {shape_str(k)}, value {shape_str(v)}"


def _check_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise AttentionTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise AttentionTypeError(
            f"{name} must have a floating-point dtype (float16, bfloat16, float32 or float64), "
            f"got {t.dtype} with shape {shape_str(t)}"
        )
    if t.dim() < 2:
        raise AttentionValueError(f"{name} must have at least 2 dimensions (..., N, D), got shape {shape_str(t)}")
    return t


def check_bool(name: str, value: object) -> bool:
    """A flag must be a Python bool, as torch's SDPA requires: ``is_causal="no"`` is an error, not True."""
    if not isinstance(value, bool):
        raise AttentionTypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def real_number(name: str, value: object) -> float:
    """A Python or numpy real number, or a one-element tensor, as a float (torch's SDPA takes all three)."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex():
            raise AttentionTypeError(f"{name} must be a real number, got a tensor of shape {shape_str(value)}")
        if value.requires_grad:
            # A float cannot carry its gradient; refusing beats silently dropping it (torch refuses too).
            raise AttentionTypeError(f"{name} must not require grad: it is used as a plain number")
        return float(value.item())
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, np.ndarray) and value.size == 1 and (torch.compiler.is_compiling() or np.isrealobj(value)):
        # a 0-d array: torch.compile traces a numpy scalar as one (and cannot read its dtype while tracing)
        return float(value)
    raise AttentionTypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")


def _finite(x: float) -> bool:
    """``math.isfinite`` by comparisons, which dynamo can trace for a numpy float read while compiling."""
    return x == x and -math.inf < x < math.inf  # NaN is the one value not equal to itself


def check_scale(scale: object, D: int) -> float:
    """The softmax scale: ``1 / sqrt(D)`` by default; any finite real number otherwise.

    With ``D = 0`` every score is 0 whatever the scale, so the default is 1 (torch's SDPA returns the mean
    of ``v`` there, and so does every backend here).
    """
    if scale is None:
        return 1.0 / math.sqrt(D) if D > 0 else 1.0
    value = real_number("scale", scale)
    if not _finite(value):
        raise AttentionValueError(f"scale must be finite, got {value}")
    return value


def check_dropout(dropout_p: object) -> float:
    """A dropout probability in ``[0, 1]``."""
    p = real_number("dropout_p", dropout_p)
    if not 0.0 <= p <= 1.0:
        raise AttentionValueError(f"dropout_p must be in [0, 1], got {p}")
    return p


def _broadcast_heads(H_q: int, H_k: int, H_v: int, enable_gqa: bool, qkv: tuple[Tensor, ...]) -> tuple[int, int]:
    """``(H_out, H_kv)``: the output's heads and the key/value heads after broadcasting."""
    if H_k != H_v and 1 not in (H_k, H_v):
        raise AttentionValueError(
            f"key and value heads (dim -3) must be equal or 1, got H_k={H_k} and H_v={H_v} ({_qkv_shapes(*qkv)})"
        )
    H_kv = H_v if H_k == 1 else H_k
    if H_q == H_kv or H_kv == 1:
        return H_q, H_kv  # multi-head, or multi-query (one key/value head for every query head)
    if enable_gqa:
        if H_kv == 0 or H_q % H_kv != 0:
            raise AttentionValueError(
                f"with enable_gqa=True the query heads H_q={H_q} must be a multiple of the key/value heads "
                f"H_kv={H_kv} ({_qkv_shapes(*qkv)})"
            )
        return H_q, H_kv
    if H_q == 1:
        return H_kv, H_kv  # the one query head broadcasts over the key/value heads, as torch.matmul does
    hint = "; pass enable_gqa=True for grouped-query attention" if H_kv and H_q % H_kv == 0 else ""
    raise AttentionValueError(f"query has {H_q} heads but key/value have {H_kv} ({_qkv_shapes(*qkv)}){hint}")


def _broadcast_batch(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """The broadcast of the batch shapes; equal shapes (the common case) skip ``torch.broadcast_shapes``,
    which costs more than the rest of the checks of a small call."""
    if shapes[0] == shapes[1] == shapes[2]:
        return shapes[0]
    return tuple(torch.broadcast_shapes(*shapes))


def validate_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: object = None,
    causal_align: str = "top_left",
    enable_gqa: bool = False,
    attn_mask: Tensor | None = None,
) -> AttentionShapes:
    """Check ``q, k, v`` (and an optional ``attn_mask``) and return the call's sizes.

    Raises :class:`~flashattn_teach.errors.AttentionTypeError` for wrong types or dtypes and
    :class:`~flashattn_teach.errors.AttentionValueError` for wrong shapes, devices or options, each
    naming the offending argument.
    """
    q = _check_tensor("query", q)
    k = _check_tensor("key", k)
    v = _check_tensor("value", v)
    if not (q.dtype == k.dtype == v.dtype):
        raise AttentionDtypeError(
            f"query, key and value must share one dtype, got query {q.dtype}, key {k.dtype}, value {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise AttentionValueError(
            f"query, key and value must be on one device, got query on {q.device}, key on {k.device}, "
            f"value on {v.device}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise AttentionValueError(
            f"query and key must have the same head dimension D (last dim), got query {shape_str(q)} and "
            f"key {shape_str(k)}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise AttentionValueError(
            f"key and value must have the same sequence length N_k (dim -2), got key {shape_str(k)} and "
            f"value {shape_str(v)}"
        )
    if causal_align not in CAUSAL_ALIGNS:
        raise AttentionValueError(f"causal_align must be one of {CAUSAL_ALIGNS}, got {causal_align!r}")
    enable_gqa = check_bool("enable_gqa", enable_gqa)

    rank = max(q.dim(), k.dim(), v.dim())
    if rank == 2:
        batch: tuple[int, ...] = ()
        H_q = H_kv = 1
    else:
        # Pad with leading 1s to one rank, as torch.matmul broadcasting does.
        qs, ks, vs = ((1,) * (rank - t.dim()) + tuple(t.shape) for t in (q, k, v))
        try:
            batch = _broadcast_batch(qs[:-3], ks[:-3], vs[:-3])
        except RuntimeError:
            raise AttentionValueError(
                f"the batch dimensions of query, key and value do not broadcast: {_qkv_shapes(q, k, v)}"
            ) from None
        H_q, H_kv = _broadcast_heads(qs[-3], ks[-3], vs[-3], enable_gqa, (q, k, v))
    s = AttentionShapes(
        batch=batch,
        H_q=H_q,
        H_kv=H_kv,
        N_q=q.shape[-2],
        N_k=k.shape[-2],
        D=q.shape[-1],
        D_v=v.shape[-1],
        rank=rank,
        scale=check_scale(scale, q.shape[-1]),
    )
    if attn_mask is not None:
        validate_mask(attn_mask, q, s)
    return s


def validate_mask(attn_mask: object, q: Tensor, s: AttentionShapes) -> None:
    """A mask is boolean (True = may attend) or additive, broadcastable to the scores ``(..., N_q, N_k)``.

    An additive mask has the query's dtype or float32, as torch's SDPA accepts (mixed-precision models
    build float32 masks for float16/bfloat16 activations).
    """
    if not isinstance(attn_mask, Tensor):
        raise AttentionTypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype not in (torch.bool, q.dtype, torch.float32):
        raise AttentionTypeError(
            f"attn_mask must be bool, float32 or query's dtype {q.dtype}, got {attn_mask.dtype} with shape "
            f"{shape_str(attn_mask)}{_padding_mask_hint(attn_mask, s)}"
        )
    if attn_mask.device != q.device:
        raise AttentionValueError(f"attn_mask is on {attn_mask.device} but query is on {q.device}")
    scores = s.score_shape
    try:
        fits = torch.broadcast_shapes(tuple(attn_mask.shape), scores) == torch.Size(scores)
    except RuntimeError:
        fits = False
    if not fits:
        raise AttentionValueError(
            f"attn_mask of shape {shape_str(attn_mask)} does not broadcast to the score shape "
            f"({', '.join(map(str, scores))}){_padding_mask_hint(attn_mask, s)}"
        )


def _padding_mask_hint(attn_mask: Tensor, s: AttentionShapes) -> str:
    """How to pass a transformers-style ``attention_mask (B, N_k)`` of 0/1, when the mask looks like one; only
    for a mask already refused: a 2-D ``attn_mask`` is ``(N_q, N_k)`` in torch's rules, and a ``(B, N_k)`` one
    that broadcasts as such is legal."""
    if attn_mask.dim() != 2 or len(s.batch) != 1 or tuple(attn_mask.shape) != (s.batch[0], s.N_k):
        return ""
    fix = "mask[:, None, None, :]" if attn_mask.dtype == torch.bool else "mask.bool()[:, None, None, :]"
    return (
        f". A 2-D attn_mask is (N_q, N_k); this one looks like a transformers-style padding mask (B, N_k) "
        f"(1: a token, 0: padding): pass attn_mask={fix}, a boolean (B, 1, 1, N_k) mask"
    )


def check_window(window: object) -> tuple[int, int]:
    """``(left, right)``: how far before and after its diagonal a query row sees; ``-1`` is unbounded.

    None means no window, ``(-1, -1)``.
    """
    if window is None:
        return -1, -1
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise AttentionTypeError(f"window must be a pair (left, right) of ints, got {type(window).__name__} {window!r}")
    sizes = []
    for side, w in zip(("left", "right"), window, strict=True):
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise AttentionTypeError(f"window {side} must be an int, got {type(w).__name__} {w!r}")
        if w < -1:
            raise AttentionValueError(f"window {side} must be -1 (unbounded) or at least 0, got {int(w)}")
        sizes.append(int(w))
    return sizes[0], sizes[1]


def check_softcap(softcap: object) -> float | None:
    """The logit cap: a finite positive number, or None for no cap. ``0`` is no cap too, as in flash-attn,
    whose functions default to ``softcap=0.0``."""
    if softcap is None:
        return None
    value = real_number("softcap", softcap)
    if value == 0.0:
        return None
    if not (_finite(value) and value > 0.0):
        raise AttentionValueError(f"softcap must be a finite number > 0 (or 0 or None for no cap), got {value}")
    return value


def check_alibi_slopes(slopes: object, q: Tensor, s: AttentionShapes) -> Tensor | None:
    """ALiBi slopes: a floating-point tensor of shape ``(H_q,)`` or ``(*batch, H_q)`` on the query's device."""
    if slopes is None:
        return None
    allowed = ((s.H_q,), (*s.batch, s.H_q))

    def want() -> str:
        return " or ".join(sorted({_shape_text(a)() for a in allowed}))

    if not isinstance(slopes, Tensor):
        raise AttentionTypeError(f"alibi_slopes must be a torch.Tensor of shape {want()}, got {type(slopes).__name__}")
    if not slopes.is_floating_point():
        raise AttentionTypeError(
            f"alibi_slopes must be floating-point, got {slopes.dtype} with shape {shape_str(slopes)}"
        )
    if tuple(slopes.shape) not in allowed:
        raise AttentionValueError(
            f"alibi_slopes must have shape {want()} (one slope per query head, optionally per batch element), "
            f"got {shape_str(slopes)}"
        )
    if slopes.device != q.device:
        raise AttentionValueError(f"alibi_slopes is on {slopes.device} but query is on {q.device}")
    return slopes


def values_on_host(t: object) -> bool:
    """Whether reading ``t``'s values costs no device sync: not a tensor, or a CPU one. Checks that read a
    tensor's values run on the host only then; a device tensor's run on the device (``torch._assert_async``)
    or where the kernels clamp, so that a call on CUDA tensors never waits for the GPU and a CUDA graph can
    capture it."""
    return not isinstance(t, Tensor) or t.device.type == "cpu"


def check_seqlens_k(seqlens_k: object, q: Tensor, s: AttentionShapes) -> Tensor | None:
    """Key lengths per batch element: an integer tensor of the batch shape, each in ``[0, N_k]``."""
    if seqlens_k is None:
        return None
    want = _shape_text(s.batch)
    if not isinstance(seqlens_k, Tensor):
        raise AttentionTypeError(f"seqlens_k must be a torch.Tensor of shape {want()}, got {type(seqlens_k).__name__}")
    if seqlens_k.dtype not in (torch.int32, torch.int64):
        raise AttentionTypeError(f"seqlens_k must be int32 or int64, got {seqlens_k.dtype}")
    if tuple(seqlens_k.shape) != s.batch:
        raise AttentionValueError(
            f"seqlens_k must have the batch shape {want()} (one key length per batch element), "
            f"got {shape_str(seqlens_k)}"
        )
    if seqlens_k.device != q.device:
        raise AttentionValueError(f"seqlens_k is on {seqlens_k.device} but query is on {q.device}")
    in_range = ((seqlens_k >= 0) & (seqlens_k <= s.N_k)).all()
    if torch.compiler.is_compiling() or not values_on_host(seqlens_k):
        # The lengths' values are unknown while tracing: the graph checks them when it runs (the custom op of
        # the op validates its inputs again in eager mode, with the message below). A device tensor's are
        # checked on the device too: reading them would wait for it, and no CUDA graph could capture the call.
        torch._assert_async(in_range, "seqlens_k must lie in [0, N_k]")
        return seqlens_k
    if seqlens_k.numel() and not bool(in_range):
        raise AttentionValueError(
            f"seqlens_k must lie in [0, N_k] = [0, {s.N_k}], got min {int(seqlens_k.min())}, max {int(seqlens_k.max())}"
        )
    return seqlens_k


def _shape_text(shape: tuple[int, ...]) -> Callable[[], str]:
    """``(2,)`` or ``(2, 3)``, built when an error needs it (sizes may be symbols while compiling)."""
    return lambda: "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def validate_block_sizes(block_m: object, block_n: object) -> tuple[int, int]:
    """Tile sizes are positive integers; they need not divide N and may exceed it."""
    sizes = []
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(b, bool) or not isinstance(b, int):
            raise AttentionTypeError(f"{name} must be an int, got {type(b).__name__} {b!r}")
        if b < 1:
            raise AttentionValueError(f"{name} must be at least 1, got {b}")
        sizes.append(b)
    return sizes[0], sizes[1]
