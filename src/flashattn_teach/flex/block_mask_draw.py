"""torch's drawing of a block mask (:class:`flashattn_teach.flex.block_mask.BlockMask`): ``to_string``
(:func:`drawing`, a picture of the computed blocks per (b, h)), ``str`` (:func:`summary`: shape, sparsity
and the picture) and ``repr`` (:func:`listing`: the index lists' shapes, the block size, the shape, the
sparsity and ``mask_mod``'s name), each written as torch writes it. They take the mask's values, not the
mask: ``block_mask.py`` imports this module.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch
from torch import Tensor

from .classify import MaskMod


def drawing(dense: Tensor, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
    """torch's drawing of the first ``limit`` (b, h) of ``dense`` (:meth:`BlockMask.to_dense`, int
    ``(*batch, T_r, T_c)``), each headed by its index tuple: at most ``grid_size`` cells a side (-1: one cell
    per block), each two characters, '██' if every block it covers is computed, '  ' if none is, '░░'
    otherwise."""
    dense = dense.cpu()
    *batch, T_r, T_c = dense.shape
    rows, cols = (grid_size, grid_size) if isinstance(grid_size, int) else grid_size
    step_r, step_c = max(1, -(-T_r // rows)), max(1, -(-T_c // cols))  # ceil; a size <= 0 gives steps of 1
    pictures = []
    for n, where in enumerate(itertools.product(*(range(d) for d in batch))):
        if n == limit:
            pictures += [
                "...",
                "To print out more, set BlockMask.to_string(limit=N)",
                "You can also index (BlockMask[batch, head]) to choose a specific batch or head",
            ]
            break
        table = dense[where]
        lines = [str(where)]
        for r in range(0, T_r, step_r):
            lines.append("".join(_cell(table[r : r + step_r, c : c + step_c]) for c in range(0, T_c, step_c)))
        pictures.append("\n".join(lines) + "\n")
    return "\n".join(pictures)


def _cell(section: Tensor) -> str:
    """One cell of torch's drawing: its share of computed blocks as full, empty or shaded."""
    share = float(section.to(torch.float32).mean())
    return "██" if share == 1 else "  " if share == 0 else "░░"


def summary(shape: tuple[int, ...], sparsity: float, picture: str) -> str:
    """torch's ``str`` of a block mask: its shape, sparsity and :func:`drawing`."""
    return f"BlockMask(shape={shape}, sparsity={sparsity:.2f}%, \n{picture.strip()}\n)"


def listing(
    lists: Mapping[str, Tensor | None],
    BLOCK_SIZE: tuple[int, int],
    shape: tuple[int, ...],
    sparsity: float,
    mask_mod: MaskMod,
) -> str:
    """torch's ``repr`` of a block mask: the shape of each index list in ``lists`` (name -> tensor or None,
    in torch's order), then ``BLOCK_SIZE``, ``shape``, sparsity and ``mask_mod``'s name."""
    sizes = "".join(f"    {name}={None if value is None else value.shape},\n" for name, value in lists.items())
    name = getattr(mask_mod, "__name__", mask_mod)
    return (
        f"BlockMask(\n{sizes}    BLOCK_SIZE={BLOCK_SIZE},\n    shape={shape},\n"
        f"    sparsity={sparsity:.2f}%,\n    mask_mod={name}\n)"
    )


__all__ = ["drawing", "listing", "summary"]
