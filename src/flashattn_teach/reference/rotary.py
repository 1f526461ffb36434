"""Rotary position embedding (Su et al. 2021, "RoFormer", arXiv:2104.09864), as flash-attn's
``flash_attn_with_kvcache`` applies it to the new keys and the queries of a decode step.

The first ``R = 2 * cos.shape[-1]`` features of each head are taken as ``R / 2`` pairs ``(x1, x2)``; the
pair ``p`` of the token at position ``t`` turns by the angle whose cosine and sine are ``cos[t, p]`` and
``sin[t, p]``::

    x1' = x1 cos - x2 sin          x2' = x1 sin + x2 cos           features past R are left as they are

    interleaved=True   pairs (0, 1), (2, 3), ...              (GPT-J)
    interleaved=False  pairs (0, R/2), (1, R/2 + 1), ...      (GPT-NeoX)

computed in float32 (float64 for float64 inputs) and rounded once to the input's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._layout import compute_dtype
from .._validate.inputs import shape_str, values_on_host
from ..errors import AttentionTypeError, AttentionValueError


def check_rotary(cos: Tensor, sin: Tensor, D: int) -> None:
    """``cos`` and ``sin``: floating ``(seqlen_ro, R / 2)`` tensors of one shape, with ``R <= D``."""
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, Tensor) or not t.is_floating_point() or t.dim() != 2:
            raise AttentionTypeError(
                f"{name} must be a floating-point tensor of shape (seqlen_ro, rotary_dim / 2), got "
                f"{shape_str(t) if isinstance(t, Tensor) else type(t).__name__}"
            )
    if cos.shape != sin.shape:
        raise AttentionValueError(
            f"rotary_cos {shape_str(cos)} and rotary_sin {shape_str(sin)} must have the same shape"
        )
    if 2 * cos.shape[1] > D:
        raise AttentionValueError(
            f"rotary_cos {shape_str(cos)} rotates rotary_dim = {2 * cos.shape[1]} features, more than the head "
            f"dimension {D}"
        )


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, *, interleaved: bool) -> Tensor:
    """``x (B, N, H, D)`` rotated, token ``(b, n)`` at ``positions[b, n]`` (an integer ``(B, N)`` tensor)."""
    seqlen_ro, half = cos.shape
    if values_on_host(positions) and positions.numel() and int(positions.max()) >= seqlen_ro:
        raise AttentionValueError(
            f"rotary_cos and rotary_sin have {seqlen_ro} positions, but this step rotates position "
            f"{int(positions.max())} (cache_seqlens + the new tokens): pass tables that long"
        )
    positions = positions.long().clamp(0, seqlen_ro - 1)  # a device tensor's values are not read on the host
    dt = compute_dtype(x.dtype)
    c = cos.to(dt)[positions].unsqueeze(-2)  # (B, N, 1, R / 2): one angle per pair, shared by the heads
    s = sin.to(dt)[positions].unsqueeze(-2)
    R = 2 * half
    xr = x[..., :R].to(dt)  # (B, N, H, R)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
    y1, y2 = x1 * c - x2 * s, x1 * s + x2 * c  # (B, N, H, R / 2) each
    y = torch.stack((y1, y2), dim=-1).flatten(-2) if interleaved else torch.cat((y1, y2), dim=-1)
    return torch.cat((y.to(x.dtype), x[..., R:]), dim=-1)
