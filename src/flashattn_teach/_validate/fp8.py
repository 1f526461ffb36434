"""The checks of an FP8 (e4m3) forward call, and the record of its dequantisation factors.

FlashAttention-3's convention (Shah et al. 2024, Sec. 3.3): ``q, k, v`` are ``torch.float8_e4m3fn`` and
each comes with a float32 descale of shape ``(B, H_kv)``, one per batch element and key/value head (the
query heads of key/value head ``h_kv`` share ``q_descale[b, h_kv]``). The inputs the call means are

    Q = q_fp8 * q_descale,   K = k_fp8 * k_descale,   V = v_fp8 * v_descale

and the output is bfloat16. The forward computes ``S = (q_fp8 k_fp8^T) * scale * qd * kd`` with fp32
accumulation, rounds the weights ``P`` to e4m3 for the second product ``P_fp8 V_fp8`` (fp32 accumulation)
and multiplies the output by ``vd`` (:mod:`flashattn_teach.reference.fp8` emulates it exactly on the CPU).

Forward only: a call that asks for gradients is refused by name, as are the options the FP8 kernel does
not take (dropout, an ``attn_mask``, user functions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import AttentionTypeError, AttentionValueError
from .inputs import shape_str

FP8_DTYPE = torch.float8_e4m3fn
# the float8 dtypes torch has (recent versions add more); e5m2 and the fnuz variants are refused by name
_FLOAT8 = tuple(getattr(torch, n) for n in dir(torch) if n.startswith("float8_"))
DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


@dataclass(frozen=True)
class Fp8Descale:
    """The dequantisation factors of an FP8 call, each float32 ``(B, H_kv)`` on the inputs' device (ones
    where the caller passed None): the true inputs are ``q * q``, ``k * k``, ``v * v`` of these, per batch
    element and key/value head."""

    q: Tensor
    k: Tensor
    v: Tensor

    def kernel_args(self) -> tuple[Tensor, Tensor, Tensor, int, int]:
        """``Q_DESCALE, K_DESCALE, V_DESCALE, stride_descale_b, stride_descale_h`` of the forward kernel:
        the three contiguous, so that one pair of strides serves them."""
        q, k, v = (t.contiguous() for t in (self.q, self.k, self.v))
        stride_b, stride_h = q.stride()
        return q, k, v, stride_b, stride_h


def is_fp8(t: object) -> bool:
    """Whether ``t`` is a tensor of a float8 dtype (any of torch's)."""
    return isinstance(t, Tensor) and t.dtype in _FLOAT8


def fp8_call(q: object, k: object, v: object, descales: tuple[object, object, object]) -> bool:
    """Whether a call is FP8, which :func:`check_fp8` then checks: a descale given or a float8 input. Every
    call asks, so no generators."""
    if descales[0] is None and descales[1] is None and descales[2] is None:  # is_fp8 of each, written out
        return (
            (isinstance(q, Tensor) and q.dtype in _FLOAT8)
            or (isinstance(k, Tensor) and k.dtype in _FLOAT8)
            or (isinstance(v, Tensor) and v.dtype in _FLOAT8)
        )
    return True


def check_fp8(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    descales: tuple[object, object, object],
    *,
    refused: dict[str, bool],
) -> Fp8Descale | None:
    """None for a call that is not FP8 (no float8 input, no descale); otherwise the call's checked
    :class:`Fp8Descale`. ``descales``: the caller's ``(q_descale, k_descale, v_descale)``. ``refused``: the
    caller's options the FP8 forward does not take, by name, True where the call uses one.

    Raises :class:`~flashattn_teach.errors.AttentionTypeError` for a dtype that is not e4m3 (or inputs
    that mix float8 and not) and :class:`~flashattn_teach.errors.AttentionValueError` for shapes, devices,
    options, and gradients asked for (the FP8 forward has no backward)."""
    if not fp8_call(q, k, v, descales):
        return None
    inputs = {"q": q, "k": k, "v": v}
    for name, t in inputs.items():
        if not isinstance(t, Tensor) or t.dtype != FP8_DTYPE:
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            given = [n for n, d in zip(DESCALE_NAMES, descales, strict=True) if d is not None]
            why = f" ({', '.join(given)} given)" if given else ""
            raise AttentionTypeError(
                f"an FP8 call{why} takes q, k and v all in torch.float8_e4m3fn (FA3's e4m3), got {name} {got}; "
                "quantise all three (t.to(torch.float8_e4m3fn) with a descale), or pass no descales"
            )
        if t.dim() != 4:
            raise AttentionValueError(
                f"FP8 inputs must be 4-D (B, H, N, D) (the descales are per (batch, kv head)), got {name} "
                f"{shape_str(t)}"
            )
    B, H_kv = _broadcast_sizes(q, k, v)
    checked = [_check_descale(n, d, B, H_kv, q.device) for n, d in zip(DESCALE_NAMES, descales, strict=True)]
    for option, used in refused.items():
        if used:
            raise AttentionValueError(
                f"the FP8 forward does not take {option}: run it in bfloat16 (dequantise: t.to(torch.bfloat16) "
                "* descale[..., None, None]), or leave it out"
            )
    wanting = [n for n, t in [*inputs.items(), *zip(DESCALE_NAMES, checked, strict=True)] if t.requires_grad]
    if wanting and torch.is_grad_enabled():
        raise AttentionValueError(
            f"the FP8 forward has no backward, but {', '.join(wanting)} requires grad: train in bfloat16, or "
            "call it under torch.no_grad() (or on .detach()ed tensors)"
        )
    return Fp8Descale(*checked)


def _broadcast_sizes(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int]:
    """``(B, H_kv)`` of the call after torch's broadcasting (a batch or key/value head count of 1 expands to
    the others', as in the bf16 call): the descales are per batch element and key/value head of the call,
    the factor of an input of batch 1 applying to each element it is broadcast to. Sizes that do not
    broadcast give ``q``'s batch and ``k``'s heads here and are refused by the shape checks that follow."""
    sizes = [(q.shape[0], k.shape[0], v.shape[0]), (k.shape[1], v.shape[1])]
    try:
        B, H_kv = (torch.broadcast_shapes(*((n,) for n in ns))[0] for ns in sizes)
    except RuntimeError:
        return q.shape[0], k.shape[1]
    return B, H_kv


def _check_descale(name: str, d: object, B: int, H_kv: int, device: torch.device) -> Tensor:
    """One descale: None (ones) or a float32 ``(B, H_kv)`` tensor on the inputs' device."""
    if d is None:
        return torch.ones(B, H_kv, dtype=torch.float32, device=device)
    if not isinstance(d, Tensor):
        raise AttentionTypeError(
            f"{name} must be a torch.Tensor of shape ({B}, {H_kv}) or None, got {type(d).__name__}"
        )
    if d.dtype != torch.float32:
        raise AttentionTypeError(f"{name} must be float32 (FA3's descales), got {d.dtype}; pass {name}.float()")
    if tuple(d.shape) != (B, H_kv):
        raise AttentionValueError(
            f"{name} must have shape (B, H_kv) = ({B}, {H_kv}) (one factor per batch element and key/value "
            f"head of the call, after q, k and v broadcast), got {shape_str(d)}"
        )
    if d.device != device:
        raise AttentionValueError(f"{name} is on {d.device} but the inputs are on {device}")
    return d
