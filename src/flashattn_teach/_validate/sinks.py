"""The check of attention sinks: one learned logit per query head in every softmax row (GPT-OSS's ``s_aux``,
flash-attn 4's ``learnable_sink``).

With sinks, row ``i`` of head ``h`` takes its softmax over its visible keys and one more entry, the sink
``sink_h``, whose value is zero: ``P_ij = exp(S_ij - lse_i)`` with ``lse_i = log(sum_j exp(S_ij) +
exp(sink_h))``, so the weights of the keys sum to less than one and ``O_i = sum_j P_ij V_j`` holds no sink
term. ``sink_h`` is a logit in the units of the scaled scores ``S_ij`` and is itself neither scaled,
softcapped, biased nor masked. A row that sees no key gives ``O_i = 0`` and ``lse_i = sink_h``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import AttentionTypeError, AttentionValueError
from .inputs import shape_str


def check_sinks(sinks: object, H_q: int, device: torch.device) -> Tensor | None:
    """``sinks``: None, or a floating-point tensor of shape ``(H_q,)`` on the queries' device (one logit per
    query head). Any floating dtype: the paths compute with it in their compute dtype (float32, float64 for
    float64 inputs), and its gradient comes back in its own dtype."""
    if sinks is None:
        return None
    if not isinstance(sinks, Tensor):
        raise AttentionTypeError(
            f"sinks must be a torch.Tensor of shape ({H_q},) (one logit per query head), got {type(sinks).__name__}"
        )
    if not sinks.is_floating_point():
        raise AttentionTypeError(f"sinks must be floating-point, got {sinks.dtype} with shape {shape_str(sinks)}")
    if tuple(sinks.shape) != (H_q,):
        raise AttentionValueError(
            f"sinks must have shape ({H_q},) (one logit per query head, H_q = {H_q}), got {shape_str(sinks)}"
        )
    if sinks.device != device:
        raise AttentionValueError(f"sinks is on {sinks.device} but the queries are on {device}")
    return sinks
