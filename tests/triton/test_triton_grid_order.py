"""The kernels' grid order (``program_block``) agrees with its Python mirror (``masks.grid.grid_order``), with
the same constants, and each order is a permutation of the grid with the properties the simulation assumes of
it."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402
from _triton_cases import DEVICE  # noqa: E402
from triton import language as tl  # noqa: E402

from flashattn_teach.masks import grid as mirror  # noqa: E402
from flashattn_teach.masks.grid import ORDERS, grid_order, heads_per_group  # noqa: E402
from flashattn_teach.triton.kernels import grid as kernel_grid  # noqa: E402
from flashattn_teach.triton.kernels.grid import INDEX, LONGEST, PER_HEAD, program_block  # noqa: E402


@triton.jit
def _order_probe(OUT, n_blocks, n_bh, n_rows, ORDER: tl.constexpr, LONGEST_LAST: tl.constexpr, ROW_BYTES: tl.constexpr):
    pid = tl.program_id(0)
    block, bh = program_block(pid, n_blocks, n_bh, n_rows, ORDER, LONGEST_LAST, ROW_BYTES)
    tl.store(OUT + pid * 2, block)
    tl.store(OUT + pid * 2 + 1, bh)


def _kernel_order(n_blocks, n_bh, n_rows, order, longest_last, row_bytes):
    out = torch.full((n_blocks * n_bh, 2), -1, dtype=torch.int32, device=DEVICE)
    _order_probe[(n_blocks * n_bh,)](out, n_blocks, n_bh, n_rows, order, longest_last, row_bytes)
    return [tuple(r) for r in out.cpu().tolist()]


# (n_blocks, n_bh, n_rows, row_bytes): groups of 2 heads over 5 (a smaller last group), of 1, and of all
_GRIDS = [(3, 5, 1024, 8 * 1024), (4, 3, 8192, 4096), (2, 4, 16, 16)]


@pytest.mark.parametrize("order", sorted(ORDERS.values()))
@pytest.mark.parametrize("longest_last", [True, False])
@pytest.mark.parametrize("grid", _GRIDS)
def test_kernel_order_matches_python_mirror(order, longest_last, grid):
    n_blocks, n_bh, n_rows, row_bytes = grid
    expected = grid_order(n_blocks, n_bh, n_rows, order, longest_last, row_bytes)
    assert _kernel_order(n_blocks, n_bh, n_rows, order, longest_last, row_bytes) == expected


def test_mirror_constants_are_the_kernels():
    assert (mirror.INDEX, mirror.PER_HEAD, mirror.LONGEST) == (INDEX.value, PER_HEAD.value, LONGEST.value)
    assert mirror.L2_GROUP_BYTES == kernel_grid.L2_GROUP_BYTES.value
    assert sorted(ORDERS.values()) == [INDEX.value, PER_HEAD.value, LONGEST.value]


@pytest.mark.parametrize("order", sorted(ORDERS.values()))
def test_every_order_is_a_permutation_of_the_grid(order):
    got = grid_order(4, 7, 2048, order, True, 4096)
    assert sorted(got) == [(i, bh) for i in range(4) for bh in range(7)]


def test_orders_hand_written():
    """Two heads of three blocks, the last block the longest; LONGEST with one group of both heads."""
    assert heads_per_group(16, 16) >= 2
    assert grid_order(3, 2, 16, INDEX.value, True, 16) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert grid_order(3, 2, 16, PER_HEAD.value, True, 16) == [(2, 0), (1, 0), (0, 0), (2, 1), (1, 1), (0, 1)]
    assert grid_order(3, 2, 16, LONGEST.value, True, 16) == [(2, 0), (2, 1), (1, 0), (1, 1), (0, 0), (0, 1)]
    # dK/dV: the first block is the longest
    assert grid_order(3, 2, 16, LONGEST.value, False, 16) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]


def test_longest_groups_keep_few_heads_in_flight():
    """With groups of 2 heads (16 MiB / 8 MiB per head), the first 2 * n_blocks programs are heads 0 and 1."""
    n_rows, row_bytes = 8192, 1024  # 8 MiB per head
    assert heads_per_group(n_rows, row_bytes) == 2
    got = grid_order(4, 5, n_rows, LONGEST.value, True, row_bytes)
    assert {bh for _, bh in got[:8]} == {0, 1}
    assert {bh for _, bh in got[16:]} == {4}  # the last group holds the one head left
    assert [i for i, _ in got[:8]] == [3, 3, 2, 2, 1, 1, 0, 0]


def test_unknown_order_is_refused():
    with pytest.raises(ValueError, match="order must be one of"):
        grid_order(2, 2, 16, 7, True, 16)
