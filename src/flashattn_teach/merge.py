"""Merging two attention results over disjoint key sets: the online-softmax update, one level up.

If ``(O_a, lse_a)`` is attention of the queries over keys ``K_a`` and ``(O_b, lse_b)`` over keys ``K_b``
(disjoint), attention over ``K_a`` and ``K_b`` together is, per query row,

    lse = log(exp(lse_a) + exp(lse_b))
    O   = exp(lse_a - lse) O_a + exp(lse_b - lse) O_b

the same rescaling the online softmax applies between two key tiles (``alpha = exp(m_old - m_new)``),
with ``lse`` in place of ``(m, l)``. Split-KV decoding (Flash-Decoding) merges the partial results of key
ranges processed in parallel, and ring attention merges the shards that arrive from other devices. The
merge is exact, commutative and associative, so partial results may be merged in any order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._layout import compute_dtype
from ._validate.inputs import shape_str
from .errors import AttentionTypeError, AttentionValueError

NEG_INF = float("-inf")


def _float_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor) or not t.is_floating_point():
        what = f"a {t.dtype} tensor" if isinstance(t, Tensor) else type(t).__name__
        raise AttentionTypeError(f"{name} must be a floating-point torch.Tensor, got {what}")
    return t


def _check(o_a: object, lse_a: object, o_b: object, lse_b: object) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    o_a, lse_a = _float_tensor("o_a", o_a), _float_tensor("lse_a", lse_a)
    o_b, lse_b = _float_tensor("o_b", o_b), _float_tensor("lse_b", lse_b)
    if o_a.shape != o_b.shape or o_a.dtype != o_b.dtype:
        raise AttentionValueError(
            f"o_a and o_b must have one shape and dtype, got o_a {shape_str(o_a)} {o_a.dtype} and "
            f"o_b {shape_str(o_b)} {o_b.dtype}"
        )
    if o_a.dim() < 1 or lse_a.shape != o_a.shape[:-1] or lse_b.shape != o_a.shape[:-1]:
        raise AttentionValueError(
            f"lse_a and lse_b must have o's shape without its last dim, {tuple(o_a.shape[:-1])}, got lse_a "
            f"{shape_str(lse_a)} and lse_b {shape_str(lse_b)}"
        )
    if len({o_a.device, lse_a.device, o_b.device, lse_b.device}) != 1:
        raise AttentionValueError(
            f"o_a, lse_a, o_b and lse_b must be on one device, got {o_a.device}, {lse_a.device}, {o_b.device}, "
            f"{lse_b.device}"
        )
    return o_a, lse_a, o_b, lse_b


def merge_attention_states(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Attention over the union of two disjoint key sets, from the attention over each.

    Args:
        o_a, o_b: ``(..., N_q, D_v)`` outputs over each key set, one shape and dtype.
        lse_a, lse_b: ``(..., N_q)`` their log-sum-exps; ``-inf`` for a row that saw no key of that set
            (its output row is then ignored).

    Returns:
        ``(O, lse)``: ``O`` of shape ``(..., N_q, D_v)`` in ``o_a``'s dtype and ``lse`` of shape
        ``(..., N_q)`` in float32 (float64 when ``o_a`` or an ``lse`` is float64). A row that saw no key in
        either set gets ``O = 0`` and ``lse = -inf``. Differentiable in all four inputs.
    """
    o_a, lse_a, o_b, lse_b = _check(o_a, lse_a, o_b, lse_b)
    wide = torch.float64 in (o_a.dtype, lse_a.dtype, lse_b.dtype)
    dt = torch.float64 if wide else compute_dtype(o_a.dtype)
    la, lb = lse_a.to(dt), lse_b.to(dt)
    # A row that saw no key on either side: logaddexp(-inf, -inf) is -inf, but its gradient is
    # exp(-inf - -inf) = NaN. Such rows take logaddexp(0, 0) instead and get -inf back by a select, whose
    # gradient into lse_a and lse_b there is 0 (as online_softmax.update handles -inf - -inf).
    empty = torch.isneginf(la) & torch.isneginf(lb)  # (..., N_q)
    lse_safe = torch.logaddexp(la.masked_fill(empty, 0.0), lb.masked_fill(empty, 0.0))  # finite where empty
    lse = lse_safe.masked_fill(empty, NEG_INF)  # (..., N_q); -inf exactly where both are -inf
    # exp(lse_x - lse) for each side: exp(-inf - log 2) = 0 for an empty row, value and gradient.
    w_a = torch.exp(la - lse_safe).unsqueeze(-1)  # (..., N_q, 1)
    w_b = torch.exp(lb - lse_safe).unsqueeze(-1)
    # A side with weight 0 contributes nothing, even if its output row holds garbage (or NaN).
    O = torch.where(w_a > 0, w_a * o_a.to(dt), 0.0) + torch.where(w_b > 0, w_b * o_b.to(dt), 0.0)
    return O.to(o_a.dtype), lse
