"""FlexAttention's mask combinators: :func:`and_masks`, :func:`or_masks` and :func:`noop_mask` (torch's
semantics; the functions they build are ordinary ``mask_mod`` functions, which the tiles, the block-mask
classification and the Triton translator all take)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import AttentionTypeError
from .classify import MaskMod


def noop_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Every key visible: a shape-() True, which broadcasts to any tile."""
    return b.new_ones((), dtype=torch.bool)


def _check_mask_mods(name: str, mask_mods: tuple[object, ...]) -> None:
    for position, fn in enumerate(mask_mods):
        if not callable(fn):
            raise AttentionTypeError(
                f"{name}: argument {position} is a {type(fn).__name__}, not a mask_mod; pass functions "
                "(b, h, q_idx, kv_idx) -> bool tensor"
            )


def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """A mask_mod visible where every one of ``mask_mods`` is (all visible when given none)."""
    _check_mask_mods("and_masks", mask_mods)

    def and_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        visible = b.new_ones((), dtype=torch.bool)
        for fn in mask_mods:
            visible = visible & fn(b, h, q_idx, kv_idx)
        return visible

    return and_mask


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """A mask_mod visible where any of ``mask_mods`` is (nothing visible when given none)."""
    _check_mask_mods("or_masks", mask_mods)

    def or_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        visible = b.new_zeros((), dtype=torch.bool)
        for fn in mask_mods:
            visible = visible | fn(b, h, q_idx, kv_idx)
        return visible

    return or_mask
