"""Launcher of the block-mask classification kernel (:mod:`flashattn_teach.triton.kernels.block_mask`):
``create_block_mask`` on CUDA runs the user's ``mask_mod``, translated to ``@triton.jit``
(:func:`flashattn_teach.triton.usermod.compile_mask_mod`), one program per (b, h, query block).

When the function cannot be translated (an operation the translator does not take, more than
``MAX_CAPTURES`` captured tensors, a capture on another device) or the block size is not a power of two,
:func:`triton_block_kinds` returns None and ``create_block_mask`` classifies with torch ops on the device,
chunk by chunk (:func:`flashattn_teach.flex.classify.tile_visibility`), with the same result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..errors import AttentionValueError
from ..flex.classify import MaskMod, result_dims
from ..flex.mods import KIND_FULL, KIND_PARTIAL, KIND_SKIP
from . import devices
from .support import triton_reason
from .usermod import UnsupportedUserFunction, compile_mask_mod

MAX_CAPTURE_SLOTS = 4  # the kernel's pointer arguments C0..C3


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def launch_block_kinds(
    mask_jit: Callable[..., object],
    captures: Sequence[Tensor],
    B_o: int,
    H_o: int,
    N_q: int,
    N_k: int,
    block_m: int,
    block_n: int,
    device: torch.device,
) -> Tensor:
    """int8 ``(B_o, H_o, T_r, T_c)``: the kind of every ``block_m x block_n`` tile under the ``@triton.jit``
    ``mask_jit(b, h, q_idx, kv_idx, C0, C1, C2, C3)``, reading ``captures`` (at most four, on ``device``)
    through C0.. in order. ``B_o``/``H_o`` of 1: the function does not read b/h (program index 0 only)."""
    from .kernels.block_mask import block_kinds_kernel  # imports triton

    if len(captures) > MAX_CAPTURE_SLOTS:
        raise AttentionValueError(
            f"launch_block_kinds: {len(captures)} captured tensors, the kernel takes at most {MAX_CAPTURE_SLOTS}"
        )
    if not (_power_of_two(block_m) and _power_of_two(block_n)):
        raise AttentionValueError(
            f"launch_block_kinds: block sizes must be powers of two (tl.arange), got {block_m} x {block_n}"
        )
    T_r, T_c = -(-N_q // block_m), -(-N_k // block_n)
    kinds = torch.empty(B_o, H_o, T_r, T_c, dtype=torch.int8, device=device)
    # unused pointer slots get a tensor the generated function never reads
    C = [*captures, *[kinds] * (MAX_CAPTURE_SLOTS - len(captures))]
    # about 64 tile elements per thread (32 threads a warp): a 128 x 128 tile on 4 warps ran out of registers
    num_warps = min(8, max(1, block_m * block_n // (64 * 32)))
    with devices.device_guard(device):  # the launch goes to the current GPU: make it the tensors' one
        block_kinds_kernel[(B_o, H_o, T_r)](
            kinds,
            *kinds.stride(),
            N_q,
            N_k,
            T_c,
            *C,
            MASK_MOD=mask_jit,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            KIND_SKIP=KIND_SKIP,
            KIND_PARTIAL=KIND_PARTIAL,
            KIND_FULL=KIND_FULL,
            num_warps=num_warps,
        )
    return kinds


def triton_block_kinds(
    mask_mod: MaskMod, B: int, H: int, N_q: int, N_k: int, block_m: int, block_n: int, device: torch.device
) -> Tensor | None:
    """The kinds of ``mask_mod``'s tiles, int8 ``(B|1, H|1, T_r, T_c)``, from the Triton kernel; None when it
    cannot run this function (see the module docstring); then the caller classifies with torch ops."""
    from ..flex.captures import captured_tensors  # the lead's module (flex/captures.py)

    if triton_reason() is not None or not (_power_of_two(block_m) and _power_of_two(block_n)):
        return None
    try:
        compiled = compile_mask_mod(mask_mod, captured_tensors(mask_mod))
    except UnsupportedUserFunction:
        return None
    # the kernel reads the captures through raw pointers: each must be on the device
    if len(compiled.captures) > MAX_CAPTURE_SLOTS or any(c.device != device for c in compiled.captures):
        return None
    B_o, H_o = result_dims(mask_mod, B, H, device)
    return launch_block_kinds(compiled.jit, compiled.captures, B_o, H_o, N_q, N_k, block_m, block_n, device)
