"""FlexAttention's programmable attention: user ``score_mod`` and ``mask_mod`` functions and block masks.

    mods.py               UserMods: a call's functions, run on each tile's broadcast index tensors; their backward
    captures.py           the tensors a function captures (closures, globals, defaults, partials, modules)
    block_mask.py         BlockMask: one table of tile kinds (SKIP, PARTIAL, FULL), and torch's index lists
    block_mask_args.py    torch's BlockMask argument names, defaults and checks
    index_lists.py        torch's index lists to and from the kinds table
    block_mask_views.py   torch's views: block_mask[b, h, q_blocks] and _adjust
    block_mask_draw.py    torch's drawing: to_string, str, repr
    block_mask_build.py   a BlockMask classified from a mask_mod (create_block_mask's work)
    classify.py           mask_mod tile by tile over chunks of tiles, never N_q x N_k; re-tiling a kinds table
    combinators.py        and_masks, or_masks, noop_mask

The public functions are :func:`flashattn_teach.flex_attention` and :func:`flashattn_teach.create_block_mask`
(:mod:`flashattn_teach.api`); the Triton translation of the functions is :mod:`flashattn_teach.triton.usermod`.
"""

from .block_mask import BlockMask
from .combinators import and_masks, noop_mask, or_masks

__all__ = ["BlockMask", "and_masks", "noop_mask", "or_masks"]
