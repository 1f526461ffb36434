"""The IO model of ring attention: a step's transfer against its attention, the crossover shard length, and
the causal load balance of the zigzag split."""

from __future__ import annotations

import pytest

from flashattn_teach.tools import iomodel
from flashattn_teach.tools.iomodel import Problem

HW = iomodel.RingHardware()  # 450 GB/s, 989 TFLOP/s x 0.5


@pytest.mark.parametrize("pass_", ["forward", "backward"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("H", "kv_heads", "d", "e"), [(1, None, 128, 2), (32, 8, 64, 2), (8, 1, 128, 4)])
def test_at_the_crossover_a_steps_transfer_takes_as_long_as_its_attention(pass_, causal, H, kv_heads, d, e):
    p = Problem(2, H, 1 << 16, d, elem_bytes=e, causal=causal)
    x = iomodel.crossover_n_local(p, HW, pass_, kv_heads)

    def comm_minus_compute(n: float) -> float:
        return (
            iomodel.step_bytes(p, n, pass_, kv_heads) / HW.bandwidth - iomodel.step_flops(p, n, pass_) / HW.throughput
        )

    scale = iomodel.step_flops(p, x, pass_) / HW.throughput
    assert abs(comm_minus_compute(x)) <= 1e-12 * scale
    assert comm_minus_compute(0.99 * x) > 0  # shorter shards: the transfer shows
    assert comm_minus_compute(1.01 * x) < 0  # longer: it hides


def test_crossover_values_by_hand():
    p = Problem(1, 1, 8192, 128)  # bf16, H_kv = H
    fwd = iomodel.crossover_n_local(p, HW)
    assert fwd == pytest.approx(989e12 * 0.5 / 450e9)  # t e / 4c = 1: N_local* = F / BW, about 1099 tokens
    assert iomodel.crossover_n_local(p, HW, "backward") == pytest.approx(0.8 * fwd)  # 4 / (4 x 2.5)
    assert iomodel.crossover_n_local(Problem(1, 1, 8192, 128, causal=True), HW) == pytest.approx(2 * fwd)
    assert iomodel.crossover_n_local(Problem(1, 32, 8192, 128), HW, kv_heads=8) == pytest.approx(fwd / 4)
    assert iomodel.crossover_n_local(Problem(1, 1, 8192, 64, elem_bytes=4), HW) == pytest.approx(2 * fwd)


def test_a_ring_step_by_hand():
    p = Problem(2, 4, 8192, 128, elem_bytes=2)
    step = iomodel.ring_step(p, 8, HW, "forward", kv_heads=2)
    assert step.n_local == 1024
    assert step.bytes == 2 * 1024 * 128 * 2 * 2 * 2  # K and V: N_local x d x e x H_kv x B
    assert step.flops == 4 * 2 * 4 * 1024**2 * 128
    assert step.comm_s == pytest.approx(step.bytes / 450e9)
    assert step.compute_s == pytest.approx(step.flops / 494.5e12)
    assert step.hides == (step.n_local >= step.crossover_n_local)
    bwd = iomodel.ring_step(p, 8, HW, "backward", kv_heads=2)
    assert (bwd.bytes, bwd.flops) == (2 * step.bytes, 2.5 * step.flops)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_the_ring_does_the_whole_attentions_flops(world, causal):
    p = Problem(2, 3, 4096, 64, causal=causal)
    step = iomodel.ring_step(p, world, HW)
    assert world * world * step.flops == iomodel.attention_flops(p)  # W devices x W steps


def _visible_pairs(q_pos: list[int], k_pos: list[int]) -> int:
    return sum(k <= q for q in q_pos for k in k_pos)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_gives_every_device_half_a_block_at_every_causal_step_and_contiguous_does_not(world):
    N = 2 * world * 6
    n_local, chunk = N // world, N // (2 * world)

    def zigzag(r: int) -> list[int]:
        return [*range(r * chunk, (r + 1) * chunk), *range((2 * world - 1 - r) * chunk, (2 * world - r) * chunk)]

    def contiguous(r: int) -> list[int]:
        return list(range(r * n_local, (r + 1) * n_local))

    for r in range(world):
        for s in range(world):
            pairs = _visible_pairs(zigzag(r), zigzag((r - s) % world))
            diagonal = n_local // 2 if s == 0 else 0  # the two triangles' diagonals
            assert pairs == n_local**2 // 2 + diagonal
    steps = {_visible_pairs(contiguous(r), contiguous((r - s) % world)) for r in range(world) for s in range(world)}
    assert 0 in steps and n_local**2 in steps  # contiguous: idle steps and full blocks


def test_ring_rejects_a_bad_split_or_bad_kv_heads():
    with pytest.raises(ValueError, match="at least 2 devices"):
        iomodel.shard_len(Problem(1, 1, 8192, 64), 1)
    with pytest.raises(ValueError, match="W = 3 devices"):
        iomodel.shard_len(Problem(1, 1, 8192, 64), 3)
    with pytest.raises(ValueError, match="2W = 16 zigzag chunks"):
        iomodel.shard_len(Problem(1, 1, 8200, 64, causal=True), 8)  # 8200 = 8 x 1025: fine non-causal only
    assert iomodel.shard_len(Problem(1, 1, 8200, 64), 8) == 1025
    with pytest.raises(ValueError, match="divide the 4 query heads"):
        iomodel.step_bytes(Problem(1, 4, 8192, 64), 1024, kv_heads=3)
    with pytest.raises(ValueError, match="pass_"):
        iomodel.step_flops(Problem(1, 4, 8192, 64), 1024, "sideways")
    with pytest.raises(ValueError, match="efficiency"):
        iomodel.RingHardware(efficiency=1.5)
