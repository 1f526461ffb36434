"""The FP8 (e4m3) forward on the fused kernel: FlashAttention-3's convention (Shah et al. 2024, Sec. 3.3).

The forward kernel (:mod:`.kernels.forward`) built with ``FP8``: ``Q_i`` and ``K_j`` enter the first
product in e4m3 (the warpgroup MMA of sm_90 takes them; ``HGMMA...E4M3`` in the SASS), the descales of the
program's (batch, key/value head) join ``qk_scale`` once, ``P_ij`` is cast to e4m3 for the second product,
and the epilogue multiplies ``O_i`` by V's descale and stores bfloat16. :mod:`flashattn_teach.reference.fp8`
emulates each rounding on the CPU. Hopper only: Ampere's MMA has no e4m3 form. Forward only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._options import AttentionOptions
from ..errors import AttentionValueError
from .configs import TEST_CONFIG, AttentionConfig, KernelConfig, block_d
from .devices import device_reason
from .launch import to_4d
from .provenance import as_tried
from .support import triton_reason
from .variants import NO_DROPOUT, KernelVariants

# the variants of the mask contract the FP8 build takes (all score modifiers and masks of the kernel that
# need no extra operand tile); the checks (_validate/fp8.py) refuse dropout, attn_mask and user functions
FP8_VARIANTS = ("window", "softcap", "alibi_slopes", "seqlens_k")

# The configurations, sm_90 only, by padded head dim (as :mod:`.configs`' tables), forward only. e4m3 tiles take
# half the shared memory of 16-bit ones; the loop's fp32 accumulator and scores are the same size. Below hd64
# none: the e4m3 MMA's K is 32, and FA3 ships FP8 from hd64. Each compiles without spills with triton 3.9
# (``python -m flashattn_teach.tools.kernels.fp8 --variants``); the widest such tiles by the loop profile.
_FORWARD: dict[int, KernelConfig] = {
    64: KernelConfig(128, 128, 8, 3),
    128: KernelConfig(128, 128, 8, 3),
    256: KernelConfig(128, 64, 8, 2),
}
# with a window, softcap and ALiBi at once (more live values per score; the tiles above spill 8 to 56 bytes)
_VARIANTS: dict[int, KernelConfig] = {
    64: KernelConfig(128, 64, 8, 3),
    128: KernelConfig(128, 64, 8, 3),
    256: KernelConfig(128, 32, 8, 2),
}


def fp8_head_dims() -> tuple[int, ...]:
    """The padded head dimensions the FP8 forward ships."""
    return tuple(_FORWARD)


def fp8_forward_config(head_dim: int, *, variants: bool = False) -> AttentionConfig:
    """The FP8 forward's configuration for a head dimension (``max(D, D_v)``) on sm_90, for a call with a
    window, softcap, ALiBi or ``seqlens_k`` (``variants``) or without; no backward."""
    d = block_d(head_dim)
    if d not in _FORWARD:
        raise AttentionValueError(f"the FP8 forward ships head dimensions 33 to 256, got {head_dim}")
    return AttentionConfig(forward=(_VARIANTS if variants else _FORWARD)[d], backward_dkdv=None, backward_dq=None)


# Whether triton's interpreter converts fp32 to e4m3 and bf16 as the GPU does (round to nearest even, with
# subnormals and the carry into the exponent). triton 3.9's does not (0.123 becomes 0.0625, 0.001 becomes 0,
# fp32 -> bf16 truncates), which changes P_ij's rounding and the stored O with no error: the interpreter is
# refused for FP8 calls unless a caller (the tests, which substitute torch's conversions) says otherwise.
INTERPRETER_ROUNDS_AS_GPU = False


def fp8_unsupported_reason(q: Tensor, opts: AttentionOptions) -> str | None:
    """None if the FP8 kernel can run this checked FP8 call, else why: triton, a CUDA device of compute
    capability 9.x (or the interpreter), head dimensions 33 to 256, and only :data:`FP8_VARIANTS`."""
    reason = triton_reason() or device_reason(q)
    if reason is not None:
        return reason
    if q.device.type == "cpu" and not INTERPRETER_ROUNDS_AS_GPU:
        return (
            "triton's interpreter rounds fp32 to e4m3 and bfloat16 differently from the GPU (the FP8 forward "
            "would give other numbers, with no error); on the CPU use any CPU backend (the emulation of the "
            "kernel's roundings)"
        )
    if q.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(q.device)
        if major != 9:
            return (
                f"the FP8 forward runs on sm_90 (Hopper) only, this GPU is sm_{major}{minor}: dequantise to "
                "bfloat16 (t.to(torch.bfloat16) * descale[..., None, None]) and call flash_attention on that"
            )
    s = opts.shapes
    for name, d in (("D", s.D), ("D_v", s.D_v)):
        if block_d(d) not in fp8_head_dims():
            return f"the FP8 forward supports head dimensions 33 to 256, got {name}={d}"
    other = [name for name in opts.mask.variants if name not in FP8_VARIANTS]
    if other:
        return f"{', '.join(other)} not in the FP8 kernel"
    return None


def triton_fp8_forward(
    q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, *, config: AttentionConfig | None = None
) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of a checked FP8 call by the fused kernel: ``O (B, H_q, N_q, D_v)`` bfloat16 and
    ``lse (B, H_q, N_q)`` float32. ``config``: default :func:`~.configs.fp8_forward_config` on CUDA and
    :data:`~.configs.TEST_CONFIG` in the interpreter. Raises
    :class:`~flashattn_teach.errors.AttentionValueError` where :func:`fp8_unsupported_reason` says why."""
    from . import launch

    reason = fp8_unsupported_reason(q, opts)
    if reason is not None:
        raise AttentionValueError(f"backend='triton' cannot run this FP8 call: {reason}")
    s = opts.shapes
    variants = KernelVariants.from_spec(opts.mask, NO_DROPOUT)
    if config is None and q.device.type == "cuda":  # without the paths no GPU has run (.provenance)
        config = as_tried(fp8_forward_config(max(s.D, s.D_v), variants=variants.used))
    elif config is None:
        config = TEST_CONFIG
    q4, k4, v4 = to_4d(q, s, s.H_q), to_4d(k, s, s.H_kv), to_4d(v, s, s.H_kv)
    return launch.forward(
        q4,
        k4,
        v4,
        s,
        causal=opts.causal,
        causal_align=opts.causal_align,
        config=config,
        variants=variants,
        descale=opts.descale,
        sinks=opts.sinks,
    )
