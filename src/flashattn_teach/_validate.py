"""Input validation shared by every backend (dense, online, key-major, Triton).

All backends accept torch's ``scaled_dot_product_attention`` layout::

    q: (..., H_q,  N_q, D)      k: (..., H_kv, N_k, D)      v: (..., H_kv, N_k, D_v)

Leading dimensions broadcast as in ``torch.matmul``. ``H_kv`` must equal ``H_q``, be 1 (broadcast, i.e.
multi-query attention) or, with ``enable_gqa=True``, divide ``H_q`` (grouped-query attention: query head
``h`` reads key/value head ``h // (H_q // H_kv)``, torch's ``repeat_interleave`` convention).

Errors name the argument and the shapes or dtypes involved, so a user can fix the call without reading
this file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

CAUSAL_ALIGNS = ("top_left", "bottom_right")


@dataclass(frozen=True)
class AttentionShapes:
    """The sizes of one attention call, after broadcasting.

    ``batch`` is the broadcast shape of all leading dimensions (those before the head dimension);
    ``rank`` is the rank of the output, which has shape ``(*batch, H_q, N_q, D_v)`` (or ``(N_q, D_v)``
    for 2-D inputs).
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
        """Query heads per key/value head (1 for plain multi-head attention)."""
        return self.H_q // self.H_kv

    @property
    def out_shape(self) -> tuple[int, ...]:
        if self.rank == 2:
            return (self.N_q, self.D_v)
        return (*self.batch, self.H_q, self.N_q, self.D_v)

    @property
    def lse_shape(self) -> tuple[int, ...]:
        return self.out_shape[:-1]


def _shape(t: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _check_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(
            f"{name} must have a floating-point dtype (float16, bfloat16, float32 or float64), "
            f"got {t.dtype} with shape {_shape(t)}"
        )
    if t.dim() < 2:
        raise ValueError(f"{name} must have at least 2 dimensions (..., N, D), got shape {_shape(t)}")
    return t


def validate_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    causal_align: str = "top_left",
    enable_gqa: bool = False,
    attn_mask: Tensor | None = None,
) -> AttentionShapes:
    """Check ``q, k, v`` (and an optional ``attn_mask``) and return the call's sizes.

    Raises ``TypeError`` for wrong types or dtypes and ``ValueError`` for wrong shapes, devices or
    options, each naming the offending argument.
    """
    q = _check_tensor("query", q)
    k = _check_tensor("key", k)
    v = _check_tensor("value", v)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"query, key and value must share one dtype, got query {q.dtype}, key {k.dtype}, value {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"query, key and value must be on one device, got query on {q.device}, key on {k.device}, "
            f"value on {v.device}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"query and key must have the same head dimension D (last dim), got query {_shape(q)} and key {_shape(k)}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"key and value must have the same sequence length N_k (dim -2), got key {_shape(k)} and value {_shape(v)}"
        )
    if q.shape[-1] == 0:
        raise ValueError(f"the head dimension D must be at least 1, got query {_shape(q)}")
    if causal_align not in CAUSAL_ALIGNS:
        raise ValueError(f"causal_align must be one of {CAUSAL_ALIGNS}, got {causal_align!r}")

    rank = max(q.dim(), k.dim(), v.dim())
    if rank == 2:
        batch: tuple[int, ...] = ()
        H_q = H_k = H_v = 1
    else:
        # Pad with leading 1s to one rank, as torch.matmul broadcasting does.
        qs, ks, vs = ((1,) * (rank - t.dim()) + tuple(t.shape) for t in (q, k, v))
        H_q, H_k, H_v = qs[-3], ks[-3], vs[-3]
        try:
            batch = tuple(torch.broadcast_shapes(qs[:-3], ks[:-3], vs[:-3]))
        except RuntimeError:
            raise ValueError(
                f"the batch dimensions of query, key and value do not broadcast: query {_shape(q)}, "
                f"key {_shape(k)}, value {_shape(v)}"
            ) from None
    if H_k != H_v:
        raise ValueError(
            f"key and value must have the same number of heads (dim -3), got key {_shape(k)} and value {_shape(v)}"
        )
    H_kv = H_k
    if H_q != H_kv and H_kv != 1:
        if not enable_gqa:
            raise ValueError(
                f"query has {H_q} heads but key/value have {H_kv} (query {_shape(q)}, key {_shape(k)}); "
                "pass enable_gqa=True for grouped-query attention"
            )
        if H_kv == 0 or H_q % H_kv != 0:
            raise ValueError(
                f"with enable_gqa=True the query heads H_q={H_q} must be a multiple of the key/value heads "
                f"H_kv={H_kv} (query {_shape(q)}, key {_shape(k)})"
            )
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float or None, got {scale!r}")
    shapes = AttentionShapes(
        batch=batch,
        H_q=H_q,
        H_kv=H_kv,
        N_q=q.shape[-2],
        N_k=k.shape[-2],
        D=q.shape[-1],
        D_v=v.shape[-1],
        rank=rank,
        scale=float(scale),
    )
    if attn_mask is not None:
        validate_mask(attn_mask, q, shapes)
    return shapes


def validate_mask(attn_mask: Tensor, q: Tensor, shapes: AttentionShapes) -> None:
    """A mask is boolean (True = may attend) or additive in query's dtype, broadcastable to scores."""
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        raise TypeError(f"attn_mask must be bool or have query's dtype {q.dtype}, got {attn_mask.dtype}")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {q.device}")
    scores = (*shapes.out_shape[:-1], shapes.N_k)
    try:
        if torch.broadcast_shapes(tuple(attn_mask.shape), scores) != torch.Size(scores):
            raise RuntimeError
    except RuntimeError:
        raise ValueError(
            f"attn_mask of shape {_shape(attn_mask)} does not broadcast to the score shape "
            f"({', '.join(map(str, scores))})"
        ) from None


def validate_block_sizes(block_m: object, block_n: object) -> tuple[int, int]:
    """Tile sizes are positive integers; they need not divide N and may exceed it."""
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(b, bool) or not isinstance(b, int):
            raise TypeError(f"{name} must be an int, got {type(b).__name__} {b!r}")
        if b < 1:
            raise ValueError(f"{name} must be at least 1, got {b}")
    return block_m, block_n  # type: ignore[return-value]
