"""Autocast: return the dtype torch's SDPA returns there, while computing in float32 inside.

Under ``torch.autocast`` torch casts the floating-point inputs of ``scaled_dot_product_attention``
(float64 excepted) to the autocast dtype and returns that dtype. Every entry point here does the same
cast, then runs its backend with autocast switched off, so that scores, running statistics and the
accumulator stay in float32 (float64 for float64 inputs) as every backend promises; left on, autocast
would run the internal matmuls in bfloat16/float16 and round the accumulator with them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts to on this device type, or None when autocast is off there."""
    try:
        return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    except (RuntimeError, ValueError):  # a device type autocast does not know (e.g. "meta")
        return None


def cast_inputs(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``q, k, v`` as autocast would hand them to torch's SDPA: in the autocast dtype, float64 untouched."""
    if not torch._C._is_any_autocast_enabled():  # most calls: one question, not one per device type
        return q, k, v
    if not all(isinstance(t, Tensor) for t in (q, k, v)):
        return q, k, v  # validation names the argument that is not a tensor
    dtype = autocast_dtype(q.device.type)
    if dtype is None:
        return q, k, v
    return tuple(  # type: ignore[return-value]
        t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in (q, k, v)
    )


@contextlib.contextmanager
def autocast_off(device_type: str) -> Iterator[None]:
    """Run the body with autocast disabled on ``device_type`` (a no-op where it is already off)."""
    if autocast_dtype(device_type) is None:
        yield
        return
    with torch.autocast(device_type, enabled=False):
        yield
