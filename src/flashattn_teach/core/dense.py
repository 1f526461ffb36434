"""The oracle: attention with the whole ``N_q x N_k`` score matrix in memory (Vaswani et al. 2017, eq. 1).

    S   = scale * Q K^T                  (B, H, N_q, N_k), scale = 1 / sqrt(D) by default
    P   = softmax(S) row by row          causal: S_ij = -inf where key j > query i (top-left aligned)
    O   = P V                            (B, H, N_q, D_v)
    lse = log(sum_j exp(S_ij))           (B, H, N_q), what the flash forward saves for its backward

Every tiled path in ``core/`` is checked against this function; in float64 it is exact to rounding. A row
that sees no key (only possible here when ``N_k = 0``) gets ``O = 0`` and ``lse = -inf``, never NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import AttentionTypeError, AttentionValueError

NEG_INF = float("-inf")


def check_inputs(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> float:
    """Raise, naming the argument and the fix, unless ``q (B, H, N_q, D)``, ``k (B, H, N_k, D)`` and
    ``v (B, H, N_k, D_v)`` are floating-point tensors of one dtype; return the scale (``1/sqrt(D)`` if None)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise AttentionTypeError(f"{name} must be a floating-point torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise AttentionValueError(
                f"{name} must be 4-D (B, H, N, D), got shape {tuple(t.shape)}; core/ has no other layout "
                "(flashattn_teach.reference takes grouped and 3-D inputs)"
            )
    if not q.dtype == k.dtype == v.dtype:
        raise AttentionTypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them")
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise AttentionValueError(
            f"expected q (B, H, N_q, D), k (B, H, N_k, D), v (B, H, N_k, D_v), got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}; core/ has no GQA: repeat k, v over the query heads"
        )
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def causal_mask(rows: tuple[int, int], cols: tuple[int, int], device: torch.device) -> Tensor:
    """``(r1 - r0, c1 - c0)`` bool, True where query row ``i`` may see key ``j``: ``j <= i`` (top-left)."""
    i = torch.arange(*rows, device=device).unsqueeze(-1)  # (Br, 1)
    j = torch.arange(*cols, device=device)  # (Bc,)
    return j <= i  # (Br, Bc)


def dense_attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of ``softmax(scale Q K^T) V``: ``q (B, H, N_q, D)``, ``k (B, H, N_k, D)``,
    ``v (B, H, N_k, D_v)`` -> ``O (B, H, N_q, D_v)``, ``lse (B, H, N_q)``, in the inputs' dtype."""
    scale = check_inputs(q, k, v, scale)
    N_q, N_k = q.shape[-2], k.shape[-2]
    S = scale * torch.matmul(q, k.transpose(-2, -1))  # (B, H, N_q, D) @ (B, H, D, N_k) -> (B, H, N_q, N_k)
    if causal:
        S = S.masked_fill(~causal_mask((0, N_q), (0, N_k), q.device), NEG_INF)
    lse = torch.logsumexp(S, dim=-1)  # (B, H, N_q); -inf for a row that sees no key
    # exp(S - lse) is exp(-inf - -inf) = NaN on a row with no key: subtract 0 there, which gives P = 0.
    P = torch.exp(S - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))  # (B, H, N_q, N_k)
    O = torch.matmul(P, v)  # (B, H, N_q, N_k) @ (B, H, N_k, D_v) -> (B, H, N_q, D_v)
    return O, lse
