"""Lane groups: how the kernels cover a head dimension with tiles whose widths are powers of two.

A tile's head-dim extent must be a power of two (and at least 16, the smallest tensor-core K). Most head
dims are padded up to one (:func:`block_d`: 80 and 96 run on 128 lanes). 192, the query/key head dim of
DeepSeek's multi-head latent attention (MLA) at prefill (128 "nope" lanes and 64 rotary ones, with
values of 128), would pad to 256, a quarter of every ``Q K^T`` product multiplying zeros; instead it runs
as two lane groups of 128 and 64 (:func:`lane_groups`, :mod:`.kernels.tiles`), and gets table rows of its
own (:func:`table_dim`).
"""

from __future__ import annotations

# D = 192 with D_v <= 128 (192 / 128: DeepSeek's MLA prefill): a row of its own, tiles for 128 + 64 lanes
SPLIT_DIM = 192
SPLIT_HEAD_DIMS = (SPLIT_DIM, 128)  # (D, D_v) of the sample call its row is compiled for


def block_d(head_dim: int) -> int:
    """Head dimension padded to a power of two (at least 16, the smallest tensor-core K)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def lane_groups(head_dim: int) -> tuple[int, int]:
    """``(BLOCK_D, BLOCK_D2)``: the kernels' lane groups of a query/key head dim. 129 to 192 (DeepSeek's MLA
    prefill has 192) run as 128 + 64 lanes, two MMAs into one accumulator (:mod:`.kernels.tiles`), where
    padding to 256 would multiply a quarter zeros at 192; every other head dim is one group,
    ``(block_d(head_dim), 0)``."""
    if 128 < head_dim <= 192:
        return 128, 64
    return block_d(head_dim), 0


def table_dim(head_dim: int, head_dim_v: int) -> int:
    """The head dim whose table row a call of these query/key and value head dims gets: 192 for a split
    query/key head dim (:func:`lane_groups`) with values of at most 128 lanes (the MLA shape, 192 / 128),
    else the larger padded one (a split head dim with wider values takes the 256 row, whose tiles hold more)."""
    if lane_groups(head_dim)[1] and block_d(head_dim_v) <= 128:
        return SPLIT_DIM
    return block_d(max(head_dim, head_dim_v))
