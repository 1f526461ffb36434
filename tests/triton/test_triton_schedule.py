"""The block-scheduler simulation (:mod:`flashattn_teach.tools.kernels.waves`): hand-computed launches, the
work of each program against a direct count of visible tiles, occupancy from resources, and the property
that longest-first is never worse than index order at the benchmark's causal shapes."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")

import torch

from flashattn_teach.tools.kernels.waves import (
    LaunchShape,
    benchmark_shapes,
    block_work,
    launch_work,
    programs_per_sm,
    simulate,
)
from flashattn_teach.triton.configs import KernelConfig, shipped_config
from flashattn_teach.triton.kernels.grid import INDEX, LONGEST, PER_HEAD


def test_three_programs_on_two_slots():
    # 3 and 2 start at 0; 1 takes the slot freed at 2 and ends at 3
    s = simulate([3, 2, 1], slots=2)
    assert s.makespan == 3 and s.ideal == 3 and s.idle_fraction == 0
    # 1 and 2 start at 0; 3 takes the slot freed at 1 and ends at 4: a quarter of 2 x 4 slot-time idle
    s = simulate([1, 2, 3], slots=2)
    assert s.makespan == 4 and s.idle_fraction == pytest.approx(0.25)
    assert s.waves == pytest.approx(1.5)


def test_ties_take_the_lowest_slot_and_one_slot_is_a_sum():
    assert simulate([2, 2, 5], slots=2).makespan == 7  # 5 starts at 2 on either slot
    assert simulate([4, 1, 1, 1], slots=1).makespan == 7
    assert simulate([], slots=3).makespan == 0
    with pytest.raises(ValueError, match="slots"):
        simulate([1], slots=0)


def test_causal_forward_work_counts_the_visible_key_blocks():
    """N = 64, tiles 16 x 16: query block i sees key blocks 0..i, the diagonal one masked."""
    c = KernelConfig(16, 16, 4, 1)
    shape = LaunchShape(1, 1, 64, 64, 16, causal=True)
    assert block_work("forward", shape, c, masked_weight=2.0) == [1 + 2, 1 + 1 + 2, 1 + 2 + 2, 1 + 3 + 2]
    # dK/dV key block j is seen by query blocks j..3, for each of the GROUP query heads; prologue 2
    grouped = LaunchShape(1, 2, 64, 64, 16, causal=True, group=2)
    assert block_work("backward_dkdv", grouped, c) == [2 + 2 * 4, 2 + 2 * 3, 2 + 2 * 2, 2 + 2 * 1]
    # not causal: every program visits all 4 key blocks, dQ's prologue is 1.5 iterations
    dense = LaunchShape(1, 1, 64, 64, 16, causal=False)
    assert block_work("backward_dq", dense, c) == [5.5] * 4


def test_causal_forward_work_with_unequal_tiles_matches_a_dense_count():
    """BLOCK_M = 32, BLOCK_N = 16, N = 80 (a ragged last block): count visible (row, key-block) pairs directly."""
    c = KernelConfig(32, 16, 4, 1)
    shape = LaunchShape(1, 1, 80, 80, 16, causal=True)
    visible = torch.ones(80, 80).tril().bool()
    expected = []
    for r0 in range(0, 80, 32):
        rows = visible[r0 : r0 + 32]
        n = sum(bool(rows[:, k0 : k0 + 16].any()) for k0 in range(0, 80, 16))
        expected.append(1.0 * 32 / 16 + n)
    assert block_work("forward", shape, c) == expected


def test_launch_work_follows_the_grid_order():
    c = KernelConfig(16, 16, 4, 1)
    shape = LaunchShape(1, 2, 48, 48, 16, causal=True)  # blocks of work 2, 3, 4 per head
    assert launch_work("forward", shape, c, INDEX.value) == [2, 3, 4, 2, 3, 4]
    assert launch_work("forward", shape, c, PER_HEAD.value) == [4, 3, 2, 4, 3, 2]
    assert launch_work("forward", shape, c, LONGEST.value) == [4, 4, 3, 3, 2, 2]


def test_programs_per_sm_from_resources():
    assert programs_per_sm("sm90", registers=255, smem_bytes=0, num_warps=8) == 1  # 256 x 32 x 8 = 65536
    assert programs_per_sm("sm90", registers=128, smem_bytes=0, num_warps=4) == 4
    assert programs_per_sm("sm90", registers=32, smem_bytes=100 * 1024, num_warps=4) == 2  # shared memory
    assert programs_per_sm("sm80", registers=32, smem_bytes=100 * 1024, num_warps=4) == 1
    assert programs_per_sm("sm90", registers=16, smem_bytes=0, num_warps=1) == 32  # the block limit


@pytest.mark.parametrize("shape", benchmark_shapes((64, 128), (2048, 8192)), ids=str)
@pytest.mark.parametrize("per_sm", [1, 2])
def test_longest_first_is_never_worse_than_index_order(shape, per_sm):
    config = shipped_config(shape.head_dim, torch.bfloat16, "sm90")
    for name in ("forward", "backward_dkdv", "backward_dq"):
        c = config.kernel(name)
        assert c is not None
        slots = 132 * per_sm
        index = simulate(launch_work(name, shape, c, INDEX.value), slots)
        longest = simulate(launch_work(name, shape, c, LONGEST.value), slots)
        assert longest.makespan <= index.makespan, name
        assert longest.ideal == pytest.approx(index.ideal)  # the same programs, reordered


def _kernels_cli(argv: list[str]) -> int:
    from flashattn_teach._cli_types import ArgumentParser
    from flashattn_teach.tools.kernels import add_arguments, run

    parser = ArgumentParser(prog="flashattn-teach kernels")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def test_schedule_cli_prints_each_order_per_kernel_and_shape(capsys):
    argv = ["--schedule", "--programs-per-sm", "1", "--head-dim", "64", "--seq-len", "1024", "4096"]
    assert _kernels_cli(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.split()[0] in ("forward", "dkdv", "dq")]
    assert [tuple(line.split()[:3:2]) for line in lines] == [
        (kernel, n) for n in ("1024", "4096") for kernel in ("forward", "dkdv", "dq")
    ]
    for line in lines:
        # ... ideal  index (idle)  per-head (idle)  longest (idle)
        ideal = float(re.search(r"(\d+)\s+\d+\s+\(", line)[1])
        index, per_head, longest = (float(m) for m in re.findall(r"(\d+)\s+\(\s*[\d.]+%\)", line))
        assert ideal <= longest <= index and longest <= per_head, line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seq-len", "2048"], "go with --schedule"),
        (["--schedule", "--loops"], "drop --loops"),
        (["--schedule", "--dtype", "float32"], "bfloat16 only"),
        (["--schedule", "--programs-per-sm", "0"], "at least 1"),
    ],
)
def test_schedule_cli_refuses_what_it_cannot_honour(argv, message, capsys):
    assert _kernels_cli(argv) == 2
    assert message in capsys.readouterr().err
