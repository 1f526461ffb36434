"""The replay's arguments: one batch element and one head of the caller's tensors, and checked indices.

A replay runs one head of one batch element; these helpers pick it out of the caller's inputs, and name
the argument when an index or a slope does not fit (:mod:`flashattn_teach.errors`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._validate.sinks import check_sinks
from ..errors import AttentionTypeError, AttentionValueError


def pick_matrix(t: Tensor, name: str, batch_index: int) -> Tensor:
    """``(N, D)`` or ``(B, N, D)`` -> the ``(N, D)`` matrix of batch element ``batch_index`` (size 1 broadcasts)."""
    if t.dim() not in (2, 3):
        raise AttentionValueError(f"{name} must have shape (N, D) or (B, N, D), got {tuple(t.shape)}")
    return t if t.dim() == 2 else t[0 if t.shape[0] == 1 else batch_index]


def one_head(t: Tensor) -> Tensor:
    """``(N, D)`` or ``(B, N, D)`` -> ``(B, 1, N, D)``: the replay runs one head of a batch (a view)."""
    return t.reshape(1, 1, *t.shape) if t.dim() == 2 else t.unsqueeze(1)


def check_index(name: str, value: object, size: int, sizes: str) -> int:
    """``value`` as an index into ``range(size)``, else an error naming the argument and ``sizes``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise AttentionTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not 0 <= value < size:
        raise AttentionValueError(f"{name} must be in [0, {size}) for {sizes}, got {value}")
    return value


def one_slope(alibi_slopes: float | Tensor | None, B: int) -> Tensor | None:
    """One slope (a number) -> ``(1,)`` (the one head's); a ``(B,)`` tensor -> ``(B, 1)`` (per batch element).
    Anything else goes on unchanged, for ``make_options`` to name."""
    if alibi_slopes is None or (isinstance(alibi_slopes, Tensor) and alibi_slopes.shape != (B,)):
        return alibi_slopes
    if isinstance(alibi_slopes, Tensor):
        return alibi_slopes.reshape(B, 1)
    if isinstance(alibi_slopes, bool) or not isinstance(alibi_slopes, (int, float)):
        raise AttentionTypeError(
            f"alibi_slopes must be a number or a tensor of shape ({B},), got {type(alibi_slopes).__name__}"
        )
    return torch.tensor([float(alibi_slopes)], dtype=torch.float64)


def one_sink(sinks: float | Tensor | None, device: torch.device) -> Tensor | None:
    """The replayed head's attention sink: a number, or a ``(1,)`` tensor (``check_sinks`` with ``H_q = 1``),
    as a ``(1,)`` tensor on ``device``; None stays None. A model's ``(H_q,)`` sinks are sliced by the caller
    (``sinks[h:h + 1]``), as its queries are: the replay runs one head."""
    if sinks is None:
        return None
    if isinstance(sinks, Tensor):
        sink = check_sinks(sinks, 1, device)
        assert sink is not None
        if not torch.isfinite(sink).all():  # the replay is on the host: the value can be read
            raise AttentionValueError(f"sinks must be finite, got {sink.tolist()}")
        return sink
    if isinstance(sinks, bool) or not isinstance(sinks, (int, float)):
        raise AttentionTypeError(f"sinks must be a number or a tensor of shape (1,), got {type(sinks).__name__}")
    if not math.isfinite(sinks):
        raise AttentionValueError(f"sinks must be finite, got {sinks}")
    return torch.tensor([float(sinks)], dtype=torch.float64, device=device)
