"""``create_block_mask``: torch's function, classifying ``mask_mod`` tile by tile, never ``N_q x N_k``.

On the CPU (and for a function the Triton translator does not take) the classification is torch ops over
chunks of tiles (:mod:`flashattn_teach.flex.classify`); on CUDA it is one Triton kernel running the
translated ``mask_mod`` (:mod:`flashattn_teach.triton.block_mask`). The block mask it returns is
:class:`flashattn_teach.flex.block_mask.BlockMask`.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable

import torch

from ..errors import AttentionTypeError, AttentionValueError
from ..flex.block_mask import BlockMask
from ..flex.block_mask_args import DEFAULT_BLOCK_SIZE, block_size
from ..flex.block_mask_build import classified_block_mask
from ..flex.classify import MaskMod
from ..reference.workers import chunk_pool


def _mask_mod_arity(mask_mod: Callable[..., object]) -> int | None:
    try:
        params = inspect.signature(mask_mod).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: give it the benefit of the doubt
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def create_block_mask(
    mask_mod: MaskMod,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: torch.device | str | None = None,
    BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
    _compile: bool = False,
    separate_full_blocks: bool = True,
    compute_dq_write_order: bool = False,
    dq_kv_order: bool = True,
) -> BlockMask:
    """torch's ``create_block_mask``: the :class:`BlockMask` of ``mask_mod(b, h, q_idx, kv_idx) -> bool`` over
    ``B x H x Q_LEN x KV_LEN`` (``B``, ``H`` None: 1, a mask shared by every batch element, head), classified
    tile by tile, never holding ``Q_LEN x KV_LEN``. ``device`` None: the current accelerator, else the CPU,
    as torch. ``block_kinds`` keeps a size-1 dim where ``mask_mod``'s result does not depend on b (h).

    ``separate_full_blocks=False`` marks every non-empty block PARTIAL (``full_*`` None), as torch.
    ``_compile`` changes nothing here (the classification is tiled already; torch deprecates it too).
    ``compute_dq_write_order=True`` is refused; ``dq_kv_order`` is only read with it, as in torch.
    """
    if not callable(mask_mod):
        raise AttentionTypeError(f"create_block_mask: mask_mod must be a function, got {type(mask_mod).__name__}")
    arity = _mask_mod_arity(mask_mod)
    if arity is not None and arity != 4:
        raise AttentionTypeError(
            f"create_block_mask: mask_mod takes {arity} arguments; it must take (b, h, q_idx, kv_idx)"
            + (
                " (a function of (score, b, h, q_idx, kv_idx) is a score_mod: pass it to flex_attention)"
                if arity == 5
                else ""
            )
        )
    if compute_dq_write_order:
        raise AttentionValueError(
            "create_block_mask: compute_dq_write_order=True (metadata for torch's deterministic block-sparse "
            "backward) is not supported; leave it False"
        )
    if not isinstance(dq_kv_order, bool):
        raise AttentionTypeError(f"create_block_mask: dq_kv_order must be a bool, got {type(dq_kv_order).__name__}")
    if _compile:
        warnings.warn(
            "create_block_mask: _compile=True has no effect in flashattn_teach (masks are classified tile by tile "
            "without torch.compile); drop the argument",
            DeprecationWarning,
            stacklevel=2,
        )
    B, H = (1 if B is None else B), (1 if H is None else H)
    for name, value in (("B", B), ("H", H), ("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise AttentionValueError(f"create_block_mask: {name} must be a positive int, got {value!r}")
    block_m, block_n = block_size(BLOCK_SIZE)
    if device is None:
        device = torch.accelerator.current_accelerator() or torch.device("cpu")
    device = torch.device(device)

    kinds = None
    if device.type == "cuda":
        from ..triton.block_mask import triton_block_kinds  # imports triton: only on CUDA

        kinds = triton_block_kinds(mask_mod, B, H, Q_LEN, KV_LEN, block_m, block_n, device)
    # kinds None: the CPU, or a function the Triton translator does not take (torch ops on the device)
    return classified_block_mask(
        mask_mod,
        B,
        H,
        Q_LEN,
        KV_LEN,
        (block_m, block_n),
        device,
        kinds=kinds,
        separate_full_blocks=separate_full_blocks,
        pool=chunk_pool(),
    )
